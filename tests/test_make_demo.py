"""``make demo``, run as a user types it (README.md's first command), over a model store in a
temp dir (``$RECSERVE_STORE``): it must exit 0, report every step, serve the path to deploy
(``recserve serve`` with co-located lookups), time at least 200 requests and set their p99 beside
docs/benchmarks.md's figure for that path with the right verdict. Whether it is within 2x is the
demo's verdict, not this test's: a timing is no pass/fail check on a shared machine (make test runs
slow tests side by side; the demo's p99 was 12 ms there against 2.7 ms on the idle VM)."""

import os
import re
import shutil
import subprocess

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_runs_every_step(tmp_path):
    from recserve.demo import bench_figure

    env = {**os.environ, "RECSERVE_STORE": str(tmp_path / "store")}
    run = subprocess.run(["make", "demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    for n in ("1.", "2.", "3.", "4.", "5.", "6.", "7."):
        assert f"== {n}" in out, f"step {n} missing:\n{out[-4000:]}"
    assert (tmp_path / "store" / "criteo" / "CURRENT").is_file(), (
        "the demo published no version into the store"
    )
    served = "recserve serve --lookups colocated" in out and "recserve serve drained and exited 0" in out
    assert served, out[-4000:]
    timed = re.search(r"p50 ([0-9.]+) ms, p99 ([0-9.]+) ms over (\d+) requests", out)
    assert timed and int(timed.group(3)) >= 200, out[-4000:]
    doc_p50, doc_p99 = bench_figure()
    verdict = re.search(rf"serve \+ co-located: p50 {doc_p50} ms, p99 {doc_p99} ms: (.*)", out)
    assert verdict, out[-4000:]  # the demo compares with the figure docs/benchmarks.md has now
    within = float(timed.group(2)) <= 2 * doc_p99
    assert verdict.group(1) == (
        "agrees (p99 within 2x)" if within else "slower than 2x: is this machine busy?"
    )
