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


@pytest.fixture
def bench(tmp_path) -> Callable[..., dict]:
    """``bench(module, name, *args, timeout_s=300)``: ``python -m loadtest.<module> --quick
    --results-dir <tmp> ARGS`` from the checkout's root (an AssertionError with its output's tail
    when it fails); returns ``<tmp>/<name>.json``."""

    def run(module: str, name: str, *args: str, timeout_s: float = 300) -> dict:
        results = tmp_path / "results"
        cmd = [sys.executable, "-m", f"loadtest.{module}", "--quick", "--results-dir", str(results), *args]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        assert done.returncode == 0, (
            f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
        return json.loads((results / f"{name}.json").read_text())

    return run


def has(result: dict, *keys: str) -> None:
    """Every one of ``keys`` is in ``result`` (an AssertionError naming those missing)."""
    missing = [k for k in keys if k not in result]
    assert not missing, f"missing {missing} in {sorted(result)}"
