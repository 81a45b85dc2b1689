"""Shared bits of the benchmark programs: timing, tables, JSON results."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "loadtest" / "results"


def venv_env() -> dict:
    """This process's environment with the checkout's venv first on PATH (``recserve``,
    ``torchrun``), for roles started on a namespace host."""
    return {**os.environ, "PATH": f"{ROOT / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}"}


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, procs=()) -> None:
    """``predicate`` true within ``timeout_s`` (a TimeoutError naming ``what``); one of ``procs``
    (name, Popen, log path) exiting first is a RuntimeError with its log's tail."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for name, proc, log in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode}: {Path(log).read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not {what} after {timeout_s}s")
        time.sleep(0.1)


def start_locust_timeline(
    host: str, rate: int, duration_s: int, timeline: Path, model: str = "criteo", key_file: str = ""
) -> subprocess.Popen:
    """Locust (``loadtest/locust_timeline.py``: 200-item JSON requests, one timeline line per
    request) against ``host`` at ``rate`` requests/s for ``duration_s``, headless, in a child
    process; ``communicate()`` it, then read ``timeline``. ``key_file``: the frontend's token file."""
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locust_timeline.py"), "--headless",
           "--host", host, "-u", str(max(1, rate // 4)), "-r", "100", "-t", f"{duration_s}s", "--stop-timeout",
           "5", "--only-summary", "--loglevel", "WARNING", "--total-rate", str(rate), "--model", model,
           "--timeline-out", str(timeline), *(["--key-file", key_file] if key_file else [])]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip


TIMELINE_COLUMNS = ("end_time", "ms", "failed", "mixed", "dense_version", "delta_seq")
"""One line per request of ``loadtest/locust_timeline.py``'s ``--timeline-out``."""


def read_timeline(path: Path) -> np.ndarray:
    """A locust timeline as a (requests, len(TIMELINE_COLUMNS)) float array (0 rows when empty)."""
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    return np.array([[float(x) for x in r] for r in rows], dtype=np.float64).reshape(
        -1, len(TIMELINE_COLUMNS)
    )


def median_us(fn: Callable[[], object], min_runs: int = 200, min_seconds: float = 0.3) -> float:
    """Median wall time of ``fn`` in microseconds over many runs (after one warm-up call)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - t0) / 1e3)
    return float(np.median(times))


def machine() -> dict:
    import os

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()}


def write_results(name: str, results: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps({**results, "machine": machine()}, indent=2) + "\n")
    return path


def report_targets(result: dict, checks: dict[str, bool]) -> None:
    """Print each target as met / MISSED and record them in ``result["targets_met"]``."""
    for text, ok in checks.items():
        print(f"  [{'met' if ok else 'MISSED'}] {text}")
    result["targets_met"] = dict(checks)


def print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths, strict=True)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    return "" if v is None else str(v)
