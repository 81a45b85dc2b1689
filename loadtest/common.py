"""What every benchmark program shares: its flags, the one timer, a trained model, locust
timelines, tables and JSON results (its processes: ``loadtest/processes.py``).

A bench's ``--quick`` runs it at tiny sizes (seconds): it checks the bench itself, its figures mean
little (``tests/loadtest/test_bench_*.py`` run every bench so in ``make test``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "loadtest" / "results"
CRITEO_TRAIN = ROOT / "data" / "criteo" / "wide_resdnn_criteo_train.tsv"
CRITEO_TEST = ROOT / "data" / "criteo" / "wide_resdnn_criteo_test.tsv"
CRITEO_SCHEMA = ROOT / "data" / "schemas" / "criteo.yaml"


def repo_env() -> dict[str, str]:
    """This process's environment with the repo first on PYTHONPATH, what was there kept (the
    wheels a GPU machine was sent with): for a benchmark's child processes."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }


# ---- flags and results ---------------------------------------------------------------------------
def parser(doc: str | None, **kw: Any) -> argparse.ArgumentParser:
    """A bench's argument parser (its description: the docstring's first line) with the flags every
    bench has: ``--quick`` and ``--results-dir``."""
    p = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0], **kw)
    p.add_argument(
        "--quick", action="store_true", help="tiny sizes, seconds: checks the bench, not the system"
    )
    p.add_argument(
        "--results-dir", type=Path, default=RESULTS, help=f"where the JSON goes (default {RESULTS})"
    )
    return p


def keep_work_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--keep-work", action="store_true", help="keep the work dir (the roles' logs, the store)")


@contextlib.contextmanager
def work_dir(name: str, keep: bool) -> Iterator[Path]:
    """A scratch directory for a bench's run, removed after it unless ``keep`` (``--keep-work``:
    its path is printed, for the roles' logs)."""
    work = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    try:
        yield work
    finally:
        if keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def parse(p: argparse.ArgumentParser, argv: list[str] | None, quick: dict[str, Any]) -> argparse.Namespace:
    r"""``p``'s arguments; with ``--quick``, ``quick`` (dest -> value) replaces the defaults (flags
    given on the command line still win). A SIGTERM then ends the bench as Ctrl-C would, through
    its ``finally``\ s: the processes it started are stopped (it killed the bench alone, and a
    SIGTERMed bench-e2e left its PS shards, worker and TorchServe running)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**quick)
        args = p.parse_args(argv)
    return args


def _exit_on_sigterm(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def machine() -> dict:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "machine": platform.machine()}


def write_results(name: str, results: dict, results_dir: Path = RESULTS) -> Path:
    """``<results_dir>/<name>.json``: ``results`` plus the machine they were measured on (merged
    into what ``results["machine"]`` already says, e.g. load averages)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    path.write_text(
        json.dumps({**results, "machine": {**machine(), **results.get("machine", {})}}, indent=2) + "\n"
    )
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


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:,.0f}"
    return "" if v is None else str(v)


def percentiles_ms(seconds: Sequence[float] | np.ndarray) -> dict:
    """p50, p99, max and mean in ms of durations given in seconds (None each when there are none)."""
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    if not len(ms):
        return {"p50_ms": None, "p99_ms": None, "max_ms": None, "mean_ms": None}
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "max_ms": round(float(ms.max()), 3),
        "mean_ms": round(float(ms.mean()), 3),
    }


# ---- the timer -----------------------------------------------------------------------------------
class Stopwatch:
    """Wall time (``time.perf_counter``) since it was made, or of a block: ``with Stopwatch() as
    sw: ...`` then ``sw.s``; until the block ends ``sw.s`` is the time so far."""

    def __init__(self) -> None:
        self._t0, self._t1 = time.perf_counter(), 0.0

    def __enter__(self) -> Stopwatch:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._t1 = time.perf_counter()

    @property
    def s(self) -> float:
        return (self._t1 or time.perf_counter()) - self._t0


def call_times(
    fn: Callable[..., object],
    min_runs: int = 200,
    min_seconds: float = 0.3,
    args: Sequence[Any] | None = None,
    warmup: int | None = None,
) -> np.ndarray:
    """Wall time (s) of each of at least ``min_runs`` calls of ``fn`` over at least ``min_seconds``,
    after ``warmup`` calls (default: one pass over ``args``, or one call): ``fn()``, or ``fn(a)``
    cycling through ``args`` (the timed calls go on from where the warm-up stopped)."""
    cycle = list(args) if args is not None else None
    warmup = (len(cycle) if cycle is not None else 1) if warmup is None else warmup
    call = (lambda i: fn(cycle[i % len(cycle)])) if cycle is not None else (lambda i: fn())
    for i in range(warmup):
        call(i)
    times: list[int] = []
    with Stopwatch() as sw:
        while len(times) < min_runs or sw.s < min_seconds:
            i = warmup + len(times)
            t0 = time.perf_counter_ns()
            call(i)
            times.append(time.perf_counter_ns() - t0)
    return np.asarray(times, dtype=np.float64) / 1e9


def median_us(fn: Callable[[], object], min_runs: int = 200, min_seconds: float = 0.3) -> float:
    """Median wall time of ``fn`` in microseconds (``call_times``)."""
    return float(np.median(call_times(fn, min_runs, min_seconds))) * 1e6


# ---- a trained model -----------------------------------------------------------------------------
def train_version(root: str | Path, seed: int = 0, publish: bool = True, data: str | Path = CRITEO_TRAIN,
                  epochs: int = 1, serving_dtype: str = "float32") -> Any:  # fmt: skip
    """Train the Criteo model into the model store at ``root`` (in-process PS) and export a version
    (published with ``publish``) with its tables in ``serving_dtype``; returns the training result
    (``.version_dir``). The training curve goes beside the versions (``root/curve-<seed>.svg``): a
    sealed version stays as sealed."""
    from training.config import TrainConfig, train_table
    from training.train import train

    cfg = TrainConfig(store=str(root), model="criteo", data=str(data), epochs=epochs, inprocess_ps=True,
                      publish=publish, progress=False, seed=seed, curve=str(Path(root) / f"curve-{seed}.svg"),
                      table=train_table(serving_dtype=serving_dtype))  # fmt: skip
    return train(cfg)


def given_or_trained(store: str | None, work: Path) -> Path:
    """The model store a bench was given (``--store``), else one with a Criteo version trained into
    ``work/store`` now (``train_version``)."""
    if store:
        return Path(store)
    root = work / "store"
    print(f"training a model into {root} ...", flush=True)
    with Stopwatch() as sw:
        train_version(root)
    print(f"  trained in {sw.s:.0f} s", flush=True)
    return root


# ---- locust timelines ----------------------------------------------------------------------------
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
    return subprocess.Popen(cmd, cwd=ROOT, env=repo_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip


TIMELINE_COLUMNS = ("end_time", "ms", "failed", "mixed", "dense_version", "delta_seq",
                    "server_ms", "worker_ms", "dense_ms", "pid")  # fmt: skip
"""One line per request of ``loadtest/locust_timeline.py``'s ``--timeline-out``."""


def read_timeline(path: Path) -> np.ndarray:
    """A locust timeline as a (requests, len(TIMELINE_COLUMNS)) float array (0 rows when empty)."""
    rows = [line.split() for line in path.read_text().splitlines() if line.strip()]
    return np.array([[float(x) for x in r] for r in rows], dtype=np.float64).reshape(
        -1, len(TIMELINE_COLUMNS)
    )
