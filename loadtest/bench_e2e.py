"""``make bench-e2e``: the whole scoring stack under locust at fixed rates, against one process.

    python -m loadtest.bench_e2e [--store DIR --model NAME] [--duration 30] [--rates 10,50,100]
                                 [--ts-workers 2] [--worker-in-handler] [--out e2e]

Trains a model into a temporary model store unless one is given, starts the local stack on this
machine (PS shards, embedding worker, TorchServe with the recserve handler), warms it up, then runs
locust headless (``loadtest/locustfile.py``: FastHttpUser, 200-item JSON requests cut from the
2,000 Criteo test rows) at each fixed rate for ``--duration`` seconds. Every request's latency is
recorded exactly (not locust's rounded buckets).

Reference: ``inprocess_p50_ms``, the same requests scored in ONE process (features, embedding
tables in memory, dense model: the Scorer over an in-process EmbeddingWorker on LocalShards).
Where the time goes, three ways, all in the same run: (1) per request under load, the handler's
``Server-Timing`` header (decode, worker, dense, encode, total) and the rest of the latency
(locust client + HTTP + TorchServe frontend and its Python worker loop); (2) ``stages_ms``: each
stage timed sequentially in this process against the running worker and PS shards (worker Forward
split into the worker's gRPC hop, its own compute and the PS fan-out); (3) CPU time per request of
each process (locust, TorchServe's JVM, the handlers, worker, PS), which a shared machine disturbs
less than wall time. Defaults: 2 TorchServe handler processes (one saturates near 80 requests/s);
token auth off (loopback only, and the output says so). ``--worker-in-handler`` runs the worker
library inside the handler instead of calling the worker process. Writes
loadtest/results/<out>.json and prints tables; stops everything at the end, also on error.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from loadtest.common import print_table, write_results

ROOT = Path(__file__).resolve().parent.parent
TEST = ROOT / "data" / "criteo" / "wide_resdnn_criteo_test.tsv"
SCHEMA = ROOT / "data" / "schemas" / "criteo.yaml"
LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
TARGETS = {"p99_ms_at_50": 10.0, "failures": 0, "p50_at_10_over_inprocess": 3.0}


def train_model(root: Path) -> None:
    from training.config import TrainConfig
    from training.train import train

    # curve outside the version dir: the sealed version's checksums must stay valid
    train(TrainConfig(store=str(root), model="criteo", epochs=1, inprocess_ps=True, publish=True,
                      progress=False, curve=str(root / "curve.png")))  # fmt: skip


def request_bodies() -> list[bytes]:
    from serving.scoring.client import requests_from_file

    return [body for body, _ in requests_from_file(str(TEST), str(SCHEMA), 200)]


def percentiles(ms: np.ndarray) -> dict:
    if not len(ms):
        return {"p50_ms": None, "p99_ms": None, "max_ms": None, "mean_ms": None}
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "max_ms": round(float(ms.max()), 3),
        "mean_ms": round(float(ms.mean()), 3),
    }


# ---- CPU accounting (robust to a shared machine: CPU time, not wall time) ------------------------
def children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(stat.parent.name))
    return kids


def stack_processes(state: dict) -> dict[str, list[int]]:
    """Role -> pids: the PS shards, the worker, TorchServe's JVM and its Python handler processes."""
    pids = state["pids"]
    ts = int(pids["torchserve"])
    return {
        "ps": [int(p) for k, p in pids.items() if k.startswith("ps")],
        "worker": [int(pids["worker"])],
        "torchserve_frontend": [ts],
        "handler": children(ts),
        "controller": [int(pids["controller"])],
    }


def cpu_seconds(pids: list[int]) -> float:
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def cpu_snapshot(procs: dict[str, list[int]]) -> dict[str, float]:
    return {role: cpu_seconds(pids) for role, pids in procs.items()}


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
) -> dict:
    """One headless locust run at ``rate`` requests/s; exact latencies from the locustfile's dump,
    and the CPU time each part of the stack (and locust itself) spent per request."""
    users = max(1, math.ceil(rate / 4))  # 4 requests/s per user: the rate holds while latency < 250 ms; the
    # locustfile starts its schedule 1 s in (every user spawned by then), hence duration + 1 below
    out = work / f"latency-{rate:g}.txt"
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", host,
           "-u", str(users), "-r", str(users), "-t", f"{duration + 1:g}s", "--stop-timeout", "5",
           "--only-summary", "--loglevel", "WARNING", "--total-rate", str(rate), "--model", model,
           "--latency-out", str(out)]  # fmt: skip
    if key_file:
        cmd += ["--key-file", key_file]
    if binary_schema:
        cmd += ["--binary-schema", binary_schema]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    before, locust_before = cpu_snapshot(procs), _children_cpu()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=duration + 120)
    after, locust_cpu = cpu_snapshot(procs), _children_cpu() - locust_before
    if not out.exists():
        raise RuntimeError(f"locust wrote no latencies (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    ms, failed, server = read_latencies(out)
    return {
        **percentiles(ms),
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
    out = {role: round((after[role] - before[role]) / max(n, 1) * 1e3, 3) for role in before}
    out["locust"] = round(locust_cpu / max(n, 1) * 1e3, 3)
    out["total"] = round(sum(out.values()), 3)
    return out


def read_latencies(path: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """Latencies (ms), failed flags, and the p50 of each Server-Timing stage plus of what lies
    outside the handler (client + HTTP + TorchServe frontend and backend loop) per request."""
    ms, failed, stages = [], [], {}
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


# ---- where the time goes ------------------------------------------------------------------------
def median_ms(fn, args: list, min_runs: int = 100, min_seconds: float = 1.0) -> float:
    """Median wall time of ``fn(a)`` in ms, cycling through ``args`` (after one pass of warm-up)."""
    for a in args:
        fn(a)
    times, start, i = [], time.perf_counter(), 0
    while len(times) < min_runs or time.perf_counter() - start < min_seconds:
        a = args[i % len(args)]
        t0 = time.perf_counter_ns()
        fn(a)
        times.append((time.perf_counter_ns() - t0) / 1e6)
        i += 1
    return round(float(np.median(times)), 3)


def stages(
    vdir: Path, state: dict, bodies: list[bytes], runtime: str, worker_in_handler: bool
) -> tuple[dict, float]:
    """Per-stage medians (ms) of the handler's path, and the in-process p50 (ms)."""
    import model_store
    from features.codec import encode
    from features.schema import load_schema
    from features.transform import dense_matrix
    from serving.scoring.core import JSON, Scorer, ScoringConfig
    from serving.worker.client import WorkerClient
    from serving.worker.core import EmbeddingWorker, LocalShard, PSClient
    from training.offline import load_stores

    manifest = model_store.read_manifest(vdir)
    schema = load_schema(vdir / "schema.yaml")
    cfg = ScoringConfig(str(vdir), lookups="remote", worker=state["worker"], runtime=runtime)
    with contextlib.ExitStack() as es:
        local = EmbeddingWorker([LocalShard(s) for s in load_stores(vdir, manifest)], schema)
        es.callback(local.close)
        inproc = Scorer(cfg, worker=local)
        # what the handler runs: the worker process over gRPC, or the worker library over the PS
        remote = Scorer(ScoringConfig(str(vdir), lookups="remote", worker=state["worker"], runtime=runtime,
                                      ps=state["ps"] if worker_in_handler else None))  # fmt: skip
        es.callback(remote.close)
        client = WorkerClient(state["worker"])
        es.callback(client.close)
        ps = EmbeddingWorker([PSClient(a) for a in state["ps"]], schema)  # this process -> PS shards
        es.callback(ps.close)

        batches = [inproc.decode(b, JSON) for b in bodies]
        blobs = [encode(b) for b in batches]
        signs = [np.asarray(b.signs) for b in batches]
        pooled = [(local.forward(b).pooled, dense_matrix(b, schema)) for b in batches]
        scored = [inproc.predict(b) for b in batches]

        def check(status_payload):
            if status_payload[0] != 200:
                raise RuntimeError(f"scoring failed: {status_payload}")

        inprocess_p50 = median_ms(lambda b: check(inproc.score(b, JSON)), bodies)
        paced = []  # the same at 10 requests/s: caches go cold between requests, as at the 10 rps run
        for i in range(50):
            time.sleep(0.1)
            t0 = time.perf_counter()
            check(inproc.score(bodies[i % len(bodies)], JSON))
            paced.append((time.perf_counter() - t0) * 1e3)
        out = {
            "inprocess_paced_10rps": round(float(np.median(paced)), 3),
            "handler_score": median_ms(lambda b: check(remote.score(b, JSON)), bodies),
            "orjson_transform": median_ms(lambda b: inproc.decode(b, JSON), bodies),
            "codec_encode": median_ms(encode, batches),
            "worker_forward_rpc": median_ms(lambda blob: client.forward(blob, mode="infer"), blobs),
            "worker_core_over_ps": median_ms(lambda b: ps.forward(b, "infer"), batches),
            "ps_lookup_fanout": median_ms(lambda s: ps._lookup(s, insert=False), signs),
            "worker_core_inprocess_tables": median_ms(lambda b: local.forward(b, "infer"), batches),
            "dense": median_ms(lambda pd: inproc.dense(*pd), pooled),
            "encode_response": median_ms(inproc.encode, scored),
        }
    # derived: the worker's gRPC hop (server + client + codec decode) and its own compute
    out["worker_rpc_hop"] = round(out["worker_forward_rpc"] - out["worker_core_over_ps"], 3)
    out["worker_compute"] = round(out["worker_core_over_ps"] - out["ps_lookup_fanout"], 3)
    return out, inprocess_p50


def measure_rates(args, rates: list[float], state: dict, work: Path, procs: dict) -> dict:
    host = state["endpoint"].split("/predictions/")[0]
    import model_store

    served = model_store.version_dir(state["config"]["store"], args.model, state["version"])
    binary_schema = (
        str(served / "schema.yaml") if args.binary else ""
    )  # binary clients build with the served schema
    results = {}
    for rate in rates:
        r = run_locust(host, args.model, rate, args.duration, state["key_file"], work, procs,
                       binary_schema)  # fmt: skip
        results[f"{rate:g}"] = r
        print(f"  {rate:g} rps: p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, "
              f"{r['requests']} requests, {r['failures']} failures", flush=True)  # fmt: skip
    return results


# ---- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", help="existing model store (default: train one into a temp dir)")
    p.add_argument("--model", default="criteo")
    p.add_argument("--rates", default="10,50,100", help="requests/s, comma-separated")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per rate")
    p.add_argument("--warmup-s", type=float, default=5.0, help="sequential warm-up before measuring")
    p.add_argument("--token-auth", action="store_true", help="keep TorchServe token auth on")
    p.add_argument("--runtime", default="torchscript", choices=["torchscript", "onnx"])
    p.add_argument("--ts-workers", type=int, default=2, help="TorchServe handler processes (default 2)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-batch-delay-ms", type=int, default=1)
    p.add_argument(
        "--worker-in-handler",
        action="store_true",
        help="the handler runs the embedding worker library over the PS (no worker-process hop)",
    )
    p.add_argument("--ps-shards", type=int, default=0, help="PS processes (default: as trained, 2)")
    p.add_argument("--binary", action="store_true", help="send binary compact batches instead of JSON")
    p.add_argument("--out", default="e2e", help="results name: loadtest/results/<out>.json")
    args = p.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]

    import model_store
    from serving.stack.local import LocalStack, StackConfig

    work = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    stack = None
    try:
        store = Path(args.store) if args.store else work / "store"
        if not args.store:
            t0 = time.perf_counter()
            print(f"training a model into {store} ...", flush=True)
            train_model(store)
            print(f"  trained in {time.perf_counter() - t0:.0f} s", flush=True)
        version = model_store.current(store, args.model)
        vdir = model_store.version_dir(store, args.model, version)
        cfg = StackConfig(store=str(store), model=args.model, run_dir=str(work / "run"), http_port=0,
                          management_port=0, metrics_port=0, runtime=args.runtime,
                          disable_token_auth=not args.token_auth, ts_workers=args.ts_workers,
                          batch_size=args.batch_size, max_batch_delay_ms=args.max_batch_delay_ms,
                          worker_in_handler=args.worker_in_handler, ps_shards=args.ps_shards)  # fmt: skip
        print(f"starting the stack ({args.model} version {version}) ...", flush=True)
        stack = LocalStack(cfg).start()
        state = stack.state
        auth = "ON" if state["token_auth"] else "OFF (disabled for this bench, loopback only)"
        print(f"endpoint {state['endpoint']}; TorchServe token auth {auth}", flush=True)
        bodies = request_bodies()
        n = warm_up(state["endpoint"], state["key_file"], bodies, args.warmup_s)
        print(f"warm-up: {n} requests in {args.warmup_s:g} s", flush=True)

        procs = stack_processes(state)
        load_before = os.getloadavg()
        results = measure_rates(args, rates, state, work, procs)
        load_after = os.getloadavg()
        stage_ms, inprocess_p50 = stages(vdir, state, bodies, args.runtime, args.worker_in_handler)
    finally:
        if stack is not None:
            stack.stop()
        shutil.rmtree(work, ignore_errors=True)

    low = results[f"{min(rates):g}"]
    # measured per request in the lowest-rate run: the handler's Server-Timing total, and the rest of
    # each request's latency (locust client + HTTP + TorchServe frontend + its Python worker loop)
    st = low["server_timing_p50_ms"]
    stage_ms["under_load_handler_total"] = st.get("total")
    stage_ms["under_load_http_torchserve_client"] = st.get("outside_handler")
    checks = {}
    if "50" in results:
        checks["p99_at_50_le_10ms"] = results["50"]["p99_ms"] <= TARGETS["p99_ms_at_50"]
    checks["no_failures"] = all(r["failures"] == 0 for r in results.values())
    if "10" in results:
        checks["p50_at_10_le_3x_inprocess"] = results["10"]["p50_ms"] <= 3 * inprocess_p50
    out = {
        "rates": results,
        "inprocess_p50_ms": inprocess_p50,
        "stages_ms": stage_ms,
        "targets": TARGETS,
        "targets_met": checks,
        "conditions": {
            "duration_s": args.duration,
            "request_items": 200,
            "distinct_requests": len(bodies),
            "token_auth": state["token_auth"],
            "runtime": args.runtime,
            "ts_workers": args.ts_workers,
            "batch_size": args.batch_size,
            "max_batch_delay_ms": args.max_batch_delay_ms,
            "worker_in_handler": args.worker_in_handler,
            "request_format": "binary compact batch" if args.binary else "JSON",
            "ps_shards": len(state["ps"]),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in load_after],
            "note": "load generator (locust) and every stack process share this machine",
        },
    }
    path = write_results(args.out, out)

    print_table(
        f"end to end: locust FastHttpUser, 200-item {'binary compact-batch' if args.binary else 'JSON'} requests, {args.duration:g} s per rate, token auth {auth}",
        [{"rate": k, **v} for k, v in results.items()],
        ["rate", "p50_ms", "p99_ms", "max_ms", "mean_ms", "requests", "failures", "achieved_rps"],
    )
    print(f"\nin one process (features + tables in memory + dense): p50 {inprocess_p50} ms")
    print_table("stages (sequential medians, ms)", [{"stage": k, "ms": v} for k, v in stage_ms.items()],
                ["stage", "ms"])  # fmt: skip
    print_table(
        "CPU ms per request, by process (CPU time, so less sensitive to other load on the machine)",
        [{"rate": k, **v["cpu_ms_per_request"]} for k, v in results.items()],
        ["rate", "locust", "torchserve_frontend", "handler", "worker", "ps", "controller", "total"],
    )
    print_table(
        "handler Server-Timing p50 under load (ms) and the rest of each request",
        [{"rate": k, **v["server_timing_p50_ms"]} for k, v in results.items()],
        ["rate", "decode", "worker", "dense", "encode", "total", "handler_total_p99", "outside_handler",
         "outside_handler_p99"],
    )  # fmt: skip
    print(f"\ntargets: {checks}")
    print(f"load average before/after the load runs: {load_before[0]:.2f}/{load_after[0]:.2f} "
          f"on {os.cpu_count()} cpus")  # fmt: skip
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
