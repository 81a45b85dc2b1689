"""``bench``: run one benchmark program's main entry as ``make bench-<name>`` does, with
``--quick`` (tiny sizes: its figures mean little) and its results in the test's temporary directory;
the JSON it wrote. The tests that use it (``test_bench_*.py``, one per bench) check that every bench
still runs after a change and that its JSON has the figures it reports; they assert no timing
(benchmarks are programs, not timed tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STOP_S = 60.0
"""How long a bench past its timeout has to stop its processes after SIGTERM."""


@pytest.fixture
def bench(tmp_path) -> Callable[..., dict]:
    """``bench(module, name, *args, timeout_s=300)``: ``python -m loadtest.<module> --quick
    --results-dir <tmp> ARGS`` from the checkout's root (an AssertionError with its output's tail
    when it fails); returns ``<tmp>/<name>.json``. Past ``timeout_s`` the bench gets SIGTERM, so
    that it stops the processes it started on its way out (``loadtest.common.parse``), and
    SIGKILL only if it has not ended ``STOP_S`` later."""

    def run(module: str, name: str, *args: str, timeout_s: float = 300) -> dict:
        results = tmp_path / "results"
        cmd = [sys.executable, "-m", f"loadtest.{module}", "--quick", "--results-dir", str(results), *args]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) as proc:  # fmt: skip
            try:
                out, err = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    out, err = proc.communicate(timeout=STOP_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    out, err = proc.communicate()
                raise AssertionError(
                    f"{' '.join(cmd)} ran past {timeout_s:g} s (stopped, exit {proc.returncode}):\n"
                    f"{out[-3000:]}\n{err[-3000:]}"
                ) from None
        assert proc.returncode == 0, (
            f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-3000:]}\n{err[-3000:]}"
        )
        return json.loads((results / f"{name}.json").read_text())

    return run


def has(result: dict, *keys: str) -> None:
    """Every one of ``keys`` is in ``result`` (an AssertionError naming those missing)."""
    missing = [k for k in keys if k not in result]
    assert not missing, f"missing {missing} in {sorted(result)}"
