import subprocess
import sys

import pytest

from loadtest.processes import Sampler, descendants, run_sampled, running, tree, usage, wait_for
from tests.helpers import wait_until

# a child that holds 100 MB and then says so
HOLDER = "import sys, time\nb = bytearray(100 << 20)\nb[::4096] = b'x' * len(b[::4096])\nprint('ready', flush=True)\n"


def test_the_sampler_sums_a_process_trees_memory_and_cpu(tmp_path):
    code = HOLDER + "import subprocess\nkid = subprocess.Popen([sys.executable, '-c', sys.argv[1]], stdout=sys.stdout)\n" \
        "sys.stdin.read()\nkid.kill()"  # fmt: skip
    parent = subprocess.Popen([sys.executable, "-c", code, HOLDER + "sys.stdin.read()"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert parent.stdout.readline() == b"ready\n" and parent.stdout.readline() == b"ready\n"
        kids = descendants(parent.pid)
        assert len(kids) == 1 and descendants(kids[0]) == []
        one, both = usage([parent.pid]), usage(tree(parent.pid)())
        assert one.rss_bytes >= 100 << 20 and both.rss_bytes >= 200 << 20 and both.cpu_s >= one.cpu_s > 0
        with Sampler(tree(parent.pid), interval_s=0.01) as sampler:
            wait_until(lambda: len(sampler.samples) >= 3, 10, "three samples")
        assert sampler.peak_rss() >= 200 << 20 and sampler.peak_rss([(0, 1)]) == 0
    finally:
        parent.kill()
        parent.wait()


def test_run_sampled_reports_output_peaks_and_failures():
    done = run_sampled([sys.executable, "-c", HOLDER], timeout_s=60, interval_s=0.01)
    assert done.stdout == "ready\n" and done.own_peak_rss >= 100 << 20 and done.wall_s > 0
    with pytest.raises(RuntimeError, match="exited 3"):
        run_sampled([sys.executable, "-c", "import sys; sys.exit(3)"], timeout_s=60)
    with pytest.raises(TimeoutError, match="still running"):
        run_sampled([sys.executable, "-c", "import signal; signal.pause()"], timeout_s=0.5)


def test_running_waits_for_ready_and_stops_the_process_after(tmp_path):
    flag = tmp_path / "flag"
    code = f"import pathlib, signal\npathlib.Path({str(flag)!r}).touch()\nsignal.pause()"
    with running([sys.executable, "-c", code], tmp_path / "log", flag.exists, "the flag") as proc:
        assert proc.poll() is None
    assert proc.returncode is not None


def test_running_names_a_process_that_exits_before_it_is_ready(tmp_path):
    code = "print('no luck'); raise SystemExit(4)"
    with pytest.raises(RuntimeError, match="exited 4: no luck"):
        with running([sys.executable, "-c", code], tmp_path / "log", lambda: False, "never", timeout_s=60):
            pass
    with pytest.raises(TimeoutError, match="not never after 0.2s"):
        wait_for(lambda: False, 0.2, "never")


def test_a_process_not_ready_in_time_is_named_with_its_log(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text("loading version 3\nwaiting for shard 1\n")
    with subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    ) as proc:  # alive until killed
        try:
            with pytest.raises(
                TimeoutError, match="(?s)not serve-a serving after 0.2s.*serve-a's log:.*waiting for shard 1"
            ):
                wait_for(lambda: False, 0.2, "serve-a serving", [("serve-a", proc, log), ("ps-a", proc, log)])
        finally:
            proc.kill()


def test_a_dead_childs_error_line_is_kept_above_a_long_stack(tmp_path):
    from loadtest.processes import log_excerpt

    log = tmp_path / "serve.log"
    log.write_text("starting\nRuntimeError: CUDA error: operation not permitted\n" + "frame #n: ...\n" * 500)
    shown = log_excerpt(log, tail=300)
    assert shown.startswith("RuntimeError: CUDA error: operation not permitted\n...\n")
    assert shown.endswith("frame #n: ...\n") and len(shown) < 400
    log.write_text("short log, no error named\n")
    assert log_excerpt(log) == "short log, no error named\n"
