"""The reduced-precision part of ``make bench-scale``: versions served in int8 and float16 against
the float32 run of the same invocation (``loadtest/bench_scale.py``).

For each dtype a version of random rows is written in it (``loadtest/scale_store.py``: made and
encoded a chunk at a time), two ``recserve ps-serve`` processes serve it as for float32, and:

- ``load_s``: spawn -> both shards serve it (files mapped and checksummed);
- ``serving_bytes_per_row``: the PS processes' summed RSS / rows; ``bytes_per_row_ratio`` (top
  level, per dtype): that over the raw bytes of key + float32 row (8 + 4 x dim). Summed RSS counts
  each process's shared libraries and interpreter (~62 MB a ps-serve process here, ~30 MB of it
  shared) on top of the table's 8 + row + ~0.8 bytes a row: ``serving_pss_bytes_per_row`` and
  ``pss_bytes_per_row_ratio`` count every page once over the processes sharing it (PSS);
- ``lookup_p50_ms`` / ``lookup_p99_ms``: 4,000-ID ``Lookup`` calls over gRPC at ``--rate`` calls/s
  for ``--window-s`` x 4 seconds (answered as stored -- int8 codes with their scale and bias --
  and decoded by the client, as the worker asks), and ``lookup_p99_over_fp32`` against the float32
  run's steady p99;
- ``wire``: the same version's 4,000-ID lookups asked as stored and as float32 (converted by the
  PS), alternating, one at a time: ``reply_bytes``, ``p50_ms``, ``p99_ms`` each;
- ``colocated_p50_ms`` / ``colocated_p99_ms``: the same 4,000-ID gathers in this process through
  ``serving.worker.colocated.ColocatedShard`` (the files mapped here), and the float32 version's
  (``colocated_figures``, called by ``bench_scale.run`` before it removes its store).

``--int8-rows`` (default 300M, the issue's size: 11 GB of files, of which 8.8 GB mapped and as
much RSS; ~6.6 GB of arrays at the peak while a 150M-row shard is written) and
``--float16-rows`` (default ``--rows``) size them; ``--no-int8`` skips this part.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from loadtest.processes import pss_bytes, usage
from loadtest.scale_store import DIM, MODEL, SHARDS, build_version

COLOCATED_CALLS = 400
WIRE_CALLS = 300


def colocated_figures(vdir: Path, sample: np.ndarray) -> dict:
    """p50/p99 (ms) of 4,000-ID gathers from the version at ``vdir`` mapped in this process."""
    from features.hashing import shard_of
    from loadtest.bench_scale import IDS_PER_CALL
    from serving.worker.colocated import ColocatedShard

    shards = [ColocatedShard(vdir, i, SHARDS, DIM, poll_s=3600) for i in range(SHARDS)]
    try:
        owner = shard_of(sample, SHARDS)
        rng = np.random.default_rng(5)
        times = []
        for k in range(COLOCATED_CALLS):
            mine = sample[owner == k % SHARDS]
            ids = mine[rng.integers(0, len(mine), IDS_PER_CALL)]
            t0 = time.perf_counter()
            shards[k % SHARDS].rows(ids, False)
            times.append(time.perf_counter() - t0)
    finally:
        for s in shards:
            s.close()
    t = np.array(times[COLOCATED_CALLS // 10 :]) * 1e3  # the first tenth warms the caches
    return {
        "colocated_p50_ms": round(float(np.median(t)), 3),
        "colocated_p99_ms": round(float(np.percentile(t, 99)), 3),
    }


def wire_figures(clients, sample: np.ndarray, calls: int = WIRE_CALLS) -> dict:
    """Reply bytes and p50/p99 (ms) of 4,000-ID lookups of one version over gRPC asked as stored
    and as float32, alternating (the same IDs each), one call at a time."""
    from features.hashing import shard_of
    from loadtest.bench_scale import IDS_PER_CALL
    from recserve.v1 import ps_pb2

    owner = shard_of(sample, SHARDS)
    rng = np.random.default_rng(7)
    times: dict[str, list[float]] = {"stored": [], "float32": []}
    for k in range(calls):
        mine = sample[owner == k % SHARDS]
        ids = mine[rng.integers(0, len(mine), IDS_PER_CALL)]
        for mode, t in times.items():
            t0 = time.perf_counter()
            clients[k % SHARDS].lookup(ids, dtype=mode)
            t.append(time.perf_counter() - t0)
    ids = sample[owner == 0][:IDS_PER_CALL].astype("<u8").tobytes()
    out = {}
    for mode, t in times.items():
        request = ps_pb2.LookupRequest(signs=ids, stored=mode == "stored")
        resp = clients[0].stub.Lookup(request, timeout=10)
        ms_ = np.array(t[calls // 10 :]) * 1e3  # the first tenth warms the caches
        out[mode] = {
            "reply_bytes": len(resp.rows) + len(resp.qparams),
            "p50_ms": round(float(np.median(ms_)), 3),
            "p99_ms": round(float(np.percentile(ms_, 99)), 3),
        }
    return out


def serve_dtype(args, dtype: str, rows: int, fp32: dict) -> dict:
    """One version of ``rows`` rows in ``dtype``, served by two PS processes and co-located."""
    from loadtest.bench_scale import lookup_loop, wait_version
    from model_store.layout import set_current
    from serving.ps.client import PSClient
    from serving.rpc.procs import free_ports, spawn, stop_children

    base = Path(tempfile.mkdtemp(prefix=f"recserve-scale-{dtype}-", dir=args.dir or None))
    try:
        root = base / "store"
        t0 = time.perf_counter()
        version, sample = build_version(root, rows, seed=1, dtype=dtype)
        build_s = time.perf_counter() - t0
        set_current(root, MODEL, version)
        vdir = root / MODEL / version
        version_bytes = sum(f.stat().st_size for f in (vdir / "embeddings").rglob("*.npy"))
        print(f"built a {dtype} version of {rows:,} rows ({version_bytes / 1e9:.2f} GB) in {build_s:.1f} s")
        ports = free_ports(SHARDS)
        t_spawn = time.time()
        procs = [spawn(["ps-serve", str(root / MODEL), "--shard", str(i), "--num-shards", str(SHARDS),
                        "--dim", str(DIM), "--port", str(port), "--poll-s", "0.2"], base / f"ps{i}.log")
                 for i, port in enumerate(ports)]  # fmt: skip
        clients = [PSClient(f"127.0.0.1:{p}", timeout_s=5) for p in ports]
        try:
            load_s = wait_version(clients, version) - t_spawn
            time.sleep(2)
            rss, pss = usage([p.pid for p in procs]).rss_bytes, pss_bytes([p.pid for p in procs])
            calls: list = []
            stop = threading.Event()
            looper = threading.Thread(
                target=lookup_loop, args=(clients, sample, args.rate, stop, calls), daemon=True
            )
            looper.start()
            time.sleep(1 + 4 * args.window_s)
            stop.set()
            looper.join()
            wire = wire_figures(clients, sample, args.wire_calls)
        finally:
            for c in clients:
                c.close()
            stop_children(procs)
        ok = np.array([d for t, d, good, *_ in calls if good and t >= calls[0][0] + 1]) * 1e3
        p99 = float(np.percentile(ok, 99))
        out = {
            "serving_rows": rows,
            "version_gb": round(version_bytes / 1e9, 3),
            "serving_bytes_per_row": round(rss / rows, 2),
            "serving_pss_bytes_per_row": round(pss / rows, 2),
            "load_s": round(load_s, 2),
            "lookup_calls": len(calls),
            "lookup_failures": sum(1 for c in calls if not c[2]),
            "lookup_p50_ms": round(float(np.median(ok)), 3),
            "lookup_p99_ms": round(p99, 3),
            "lookup_p99_over_fp32": round(p99 / fp32["lookup_p99_steady_ms"], 3),
            "wire": wire,
        }
        out |= colocated_figures(vdir, sample)
        if "colocated_p99_ms" in fp32:
            out["colocated_p99_over_fp32"] = round(out["colocated_p99_ms"] / fp32["colocated_p99_ms"], 3)
        return out
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run(args, fp32: dict) -> dict:
    """``bytes_per_row_ratio`` {float16, int8} and a section per dtype, against ``fp32`` (the
    float32 run's serving figures)."""
    raw = 8 + 4 * DIM
    out: dict = {"float16": serve_dtype(args, "float16", args.float16_rows or args.rows, fp32)}
    out["int8"] = serve_dtype(args, "int8", args.int8_rows, fp32)
    out["bytes_per_row_ratio"] = {
        d: round(out[d]["serving_bytes_per_row"] / raw, 3) for d in ("float16", "int8")
    }
    out["float32_bytes_per_row_ratio"] = round(fp32["serving_bytes_per_row"] / raw, 3)
    out["pss_bytes_per_row_ratio"] = {
        d: round(out[d]["serving_pss_bytes_per_row"] / raw, 3) for d in ("float16", "int8")
    } | {"float32": round(fp32["serving_pss_bytes_per_row"] / raw, 3)}
    return out


def targets(r: dict) -> dict[str, bool]:
    if "int8" not in r:
        return {}
    return {
        "int8 bytes/row <= 0.45x raw key + fp32 row": r["bytes_per_row_ratio"]["int8"] <= 0.45,
        "float16 bytes/row <= 0.6x raw": r["bytes_per_row_ratio"]["float16"] <= 0.6,
        "int8 serving_rows >= 300M": r["int8"]["serving_rows"] >= 300_000_000,
        "int8 lookup p99 <= 1.2x the float32 run's": r["int8"]["lookup_p99_over_fp32"] <= 1.2,
        "no int8/float16 lookup failed": r["int8"]["lookup_failures"] + r["float16"]["lookup_failures"] == 0,
    }
