"""Driving a scoring frontend under load, for the benches: the 200-item request bodies cut from the
Criteo test rows, ``recserve serve`` on a free port (``lean_frontend``), a warm-up, and one headless
locust run at a fixed rate (``run_locust``: exact latencies from ``loadtest/locustfile.py``'s dump,
the ``Server-Timing`` stages, and the CPU time each process of the stack spent per request)."""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from loadtest.common import ROOT, percentiles_ms, repo_env
from loadtest.processes import Usage, descendants, http_ok, running, usage

if TYPE_CHECKING:
    from serving.stack.state import StackState

TEST = ROOT / "data" / "criteo" / "wide_resdnn_criteo_test.tsv"
SCHEMA = ROOT / "data" / "schemas" / "criteo.yaml"
LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"


def request_bodies(columns: bool = False) -> list[bytes]:
    from serving.scoring.client import requests_from_file

    return [body for body, _ in requests_from_file(str(TEST), str(SCHEMA), 200, columns=columns)]


# ---- CPU accounting (robust to a shared machine: CPU time, not wall time) ------------------------
def stack_processes(state: StackState) -> dict[str, list[int]]:
    """Role -> pids: the PS shards, the worker, TorchServe's JVM, its Python handler processes and
    the controller (the last three only in a stack with TorchServe)."""
    pids = state.pids
    roles = {"ps": [int(p) for k, p in pids.items() if k.startswith("ps")], "worker": [int(pids["worker"])]}
    if "torchserve" in pids:
        ts = int(pids["torchserve"])
        roles |= {
            "torchserve_frontend": [ts],
            "handler": descendants(ts),
            "controller": [int(pids["controller"])],
        }
    return roles


def cpu_snapshot(procs: dict[str, list[int]]) -> dict[str, Usage]:
    return {role: usage(pids) for role, pids in procs.items()}


# ---- load ---------------------------------------------------------------------------------------
def run_locust(
    host: str,
    model: str,
    rate: float,
    duration: float,
    key_file: str | None,
    work: Path,
    procs: dict,
    binary_schema: str = "",
    columns: bool = False,
) -> dict:
    """One headless locust run at ``rate`` requests/s; exact latencies from the locustfile's dump,
    and the CPU time each part of the stack (and locust itself) spent per request."""
    users = max(1, math.ceil(rate / 4))  # 4 requests/s per user: the rate holds while latency < 250 ms; the
    # locustfile starts its schedule 1 s in (every user spawned by then), hence duration + 1 below
    out = work / f"latency-{rate:g}.txt"
    out.unlink(missing_ok=True)  # another form's run at this rate wrote one
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", host,
           "-u", str(users), "-r", str(users), "-t", f"{duration + 1:g}s", "--stop-timeout", "5",
           "--only-summary", "--loglevel", "WARNING", "--total-rate", str(rate), "--model", model,
           "--latency-out", str(out)]  # fmt: skip
    if key_file:
        cmd += ["--key-file", key_file]
    if binary_schema:
        cmd += ["--binary-schema", binary_schema]
    if columns:
        cmd += ["--columns"]
    env = repo_env()
    before, locust_before = cpu_snapshot(procs), _children_cpu()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=duration + 120)
    after, locust_cpu = cpu_snapshot(procs), _children_cpu() - locust_before
    if not out.exists():
        raise RuntimeError(f"locust wrote no latencies (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    ms, failed, server = read_latencies(out)
    return {
        **percentiles_ms(ms / 1e3),
        "requests": int(len(ms)),
        "failures": int(failed.sum()),
        "achieved_rps": round(len(ms) / duration, 1),
        "users": users,
        "locust_exit": proc.returncode,
        "server_timing_p50_ms": server,
        "cpu_ms_per_request": _per_request(before, after, locust_cpu, len(ms)),
    }


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _per_request(before: dict, after: dict, locust_cpu: float, n: int) -> dict:
    out = {role: round((after[role].cpu_s - before[role].cpu_s) / max(n, 1) * 1e3, 3) for role in before}
    out["locust"] = round(locust_cpu / max(n, 1) * 1e3, 3)
    out["total"] = round(sum(out.values()), 3)
    return out


def read_latencies(path: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """Latencies (ms), failed flags, and the p50 of each Server-Timing stage plus of what lies
    outside the handler (client + HTTP + TorchServe frontend and backend loop) per request."""
    ms: list[float] = []
    failed: list[bool] = []
    stages: dict[str, list[float]] = {}
    for line in path.read_text().splitlines():
        lat, fail, timing = (line.split("\t") + [""])[:3]
        ms.append(float(lat))
        failed.append(fail == "1")
        parts = dict(p.strip().split(";dur=") for p in timing.split(",") if ";dur=" in p)
        for name, dur in parts.items():
            stages.setdefault(name, []).append(float(dur))
        if "total" in parts:
            stages.setdefault("outside_handler", []).append(float(lat) - float(parts["total"]))
    p50 = {k: round(float(np.median(v)), 3) for k, v in stages.items()}
    if "outside_handler" in stages:
        p50["outside_handler_p99"] = round(float(np.percentile(stages["outside_handler"], 99)), 3)
        p50["handler_total_p99"] = round(float(np.percentile(stages["total"], 99)), 3)
    return np.array(ms), np.array(failed, dtype=bool), p50


def warm_up(endpoint: str, key_file: str | None, bodies: list[bytes], seconds: float) -> int:
    from serving.scoring.client import ScoringClient

    client, n, deadline = ScoringClient(endpoint, key_file), 0, time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            status, payload = client.post(bodies[n % len(bodies)])
            if status != 200:
                raise RuntimeError(f"warm-up request failed ({status}): {payload[:300]!r}")
            n += 1
    finally:
        client.close()
    return n


@contextlib.contextmanager
def lean_frontend(
    store: Path,
    model: str,
    lookups: str,
    state: StackState | None,
    work: Path,
    runtime: str,
    batch_wait_ms: float,
    extra: tuple[str, ...] = (),
    key_file: Path | None = None,
):
    """``recserve serve`` (the command a user runs) on a free port, micro-batching its dense stage
    with ``--batch-wait-ms`` (0: off), with ``extra`` flags; remote lookups go to the stack's worker
    process. One process (``--workers 1``: the benches' figures are of one; ``extra`` may say
    ``--workers N``). Token auth off, or on with ``key_file`` (serve's ``--key-file``, made by it
    when missing). Yields (endpoint, {role: pids})."""
    from serving.rpc.procs import free_ports

    port = free_ports(1)[0]
    auth = ["--no-token-auth"] if key_file is None else ["--key-file", str(key_file)]
    argv = ["recserve", "serve", "--workers", "1", "--store", str(store), "--model", model, "--port",
            str(port), "--lookups", lookups, *auth, "--runtime", runtime,
            "--batch-wait-ms", f"{batch_wait_ms:g}", *extra]  # fmt: skip
    if state is not None:
        argv += ["--worker", state.worker]
    ping = http_ok(f"http://127.0.0.1:{port}/ping")  # 200 once a version is loaded and warm
    with running(argv, work / f"serve-{lookups}.log", ping, "recserve serve answering /ping", 120) as proc:
        procs = {"lean": [proc.pid]}
        if state is not None:
            procs.update({k: v for k, v in stack_processes(state).items() if k in ("ps", "worker")})
        yield f"http://127.0.0.1:{port}/predictions/{model}", procs
