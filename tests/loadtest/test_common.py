import signal
import subprocess
import sys

import numpy as np

from loadtest.common import TIMELINE_COLUMNS, Stopwatch, call_times, median_us, read_timeline
from tests.helpers import ROOT


def test_a_timeline_reads_as_one_row_per_request_whatever_its_length(tmp_path):
    path = tmp_path / "timeline.txt"
    path.write_text("1700000000.5 4.25 0 0 1 3 3.5 2.0 1.0 4242\n1700000000.7 9.5 1 0 -1 -1 -1 -1 -1 -1\n\n")
    tl = read_timeline(path)
    assert tl.shape == (2, len(TIMELINE_COLUMNS))
    np.testing.assert_array_equal(tl[:, TIMELINE_COLUMNS.index("delta_seq")], [3, -1])
    np.testing.assert_array_equal(tl[:, TIMELINE_COLUMNS.index("worker_ms")], [2.0, -1])
    np.testing.assert_array_equal(tl[:, TIMELINE_COLUMNS.index("pid")], [4242, -1])  # who answered
    path.write_text("")
    assert read_timeline(path).shape == (0, len(TIMELINE_COLUMNS))


def test_call_times_cycles_its_arguments_after_a_warm_up_and_times_each_call():
    seen = []
    times = call_times(seen.append, min_runs=5, min_seconds=0.0, args=["a", "b", "c"])
    assert seen == ["a", "b", "c", "a", "b", "c", "a", "b"] and len(times) == 5
    assert (times > 0).all() and median_us(lambda: None, min_runs=3, min_seconds=0.0) > 0
    seen.clear()
    assert len(call_times(seen.append, min_runs=2, min_seconds=0.0, args=[1, 2, 3, 4], warmup=1)) == 2
    assert seen == [1, 2, 3]  # the timed calls go on from where the warm-up stopped
    with Stopwatch() as sw:
        running_s = sw.s
    assert 0 < running_s <= sw.s


SIGTERMED = """
import signal
from loadtest.common import parse, parser

parse(parser("a bench"), [], {})
try:
    print("started", flush=True)
    signal.pause()  # a bench's run, until the SIGTERM
finally:
    print("stopped its processes", flush=True)
"""


def test_a_sigtermed_bench_runs_its_finally_blocks():
    proc = subprocess.Popen([sys.executable, "-c", SIGTERMED], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert out.strip() == "stopped its processes" and proc.returncode == 128 + signal.SIGTERM
