"""Every benchmark program runs: each bench's main entry as ``make bench-<name>`` runs it, with
``--quick`` (tiny sizes: its figures mean little) and its results in a temporary directory, and its
JSON has the figures the bench reports. A refactor that breaks a bench fails here, not at the next
``make bench``. Timings are not asserted (benchmarks are programs, not timed tests)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(module: str, name: str, tmp_path: Path, *args: str, timeout_s: float = 300) -> dict:
    """``python -m loadtest.<module> --quick --results-dir <tmp> ARGS`` from the checkout's root;
    the JSON it wrote (``<name>.json``)."""
    results = tmp_path / "results"
    cmd = [sys.executable, "-m", f"loadtest.{module}", "--quick", "--results-dir", str(results), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, (
        f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return json.loads((results / f"{name}.json").read_text())


def has(result: dict, *keys: str) -> None:
    missing = [k for k in keys if k not in result]
    assert not missing, f"missing {missing} in {sorted(result)}"


def test_bench_codec(tmp_path):
    result = run_bench("bench_codec", "codec", tmp_path)
    for workload in ("criteo_200", "ranking_80"):
        has(result[workload], "compact_bytes", "naive_bytes", "json_bytes", "encode_us", "decode_us",
            "transform_us", "compact/naive", "json_loads/decode")  # fmt: skip
    has(result, "targets_met", "machine")


@pytest.mark.slow
def test_bench_faults(tmp_path):
    result = run_bench("bench_faults", "faults", tmp_path)
    has(result, "failures_with_replicas", "failures_worker_kill", "failures_controller_kill", "ps_recovery_s",
        "worker_recovery_s", "controller_recovery_s", "lost_deltas", "fuzz_cases", "fuzz_server_errors",
        "scores_unchanged_by_fuzz", "restarts", "targets_met")  # fmt: skip
    assert [e["name"] for e in result["events"]] == ["ps0.1", "worker", "controller"]
