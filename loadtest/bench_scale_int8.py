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
  and decoded by the client, as the worker asks), taking turns call by call with the same calls
  to the float32 run's version, served again beside it (``fp32_same_window_p50_ms`` / ``_p99_ms``):
  ``lookup_p99_over_fp32`` is over that p99 of the same window (``_steady``: over the float32
  run's steady p99, minutes earlier);
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


def paired_loop(sides, rate: float, stop: threading.Event, outs: list[list]) -> None:
    """4,000-ID lookups at ``rate`` calls/s on each side (``(clients, sample)``: a version's shards
    and signs), the sides taking turns call by call: one window for all, so that the machine's
    drift (2x in p99 over minutes on the shared VM) does not land on one side only."""
    from features.hashing import shard_of
    from loadtest.bench_scale import IDS_PER_CALL

    rng = np.random.default_rng(3)
    parts = [[sample[shard_of(sample, SHARDS) == i] for i in range(SHARDS)] for _, sample in sides]
    period, k, t_next = 1.0 / rate, 0, time.time()
    while not stop.is_set():
        shard = k % SHARDS
        for (clients, _), by_shard, out in zip(sides, parts, outs, strict=True):
            ids = by_shard[shard][rng.integers(0, len(by_shard[shard]), IDS_PER_CALL)]
            t0 = time.time()
            try:
                ok = clients[shard].lookup(ids, timeout_s=5)[1] == 0
            except Exception:
                ok = False
            out.append((t0, time.time() - t0, ok))
        k += 1
        t_next += period
        if (delay := t_next - time.time()) > 0:
            time.sleep(delay)


def _serve(store: Path, base: Path, tag: str) -> tuple[list, list]:
    """Two ``recserve ps-serve`` processes following ``store`` (a model dir), and their clients."""
    from serving.ps.client import PSClient
    from serving.rpc.procs import free_ports, spawn

    ports = free_ports(SHARDS)
    procs = [spawn(["ps-serve", str(store), "--shard", str(i), "--num-shards", str(SHARDS), "--dim", str(DIM),
                    "--port", str(port), "--poll-s", "0.2"], base / f"{tag}-ps{i}.log")
             for i, port in enumerate(ports)]  # fmt: skip
    return procs, [PSClient(f"127.0.0.1:{p}", timeout_s=5) for p in ports]


def _figures(calls: list) -> tuple[float, float]:
    """p50 and p99 (ms) of the good calls after the first second."""
    ok = np.array([d for t, d, good, *_ in calls if good and t >= calls[0][0] + 1]) * 1e3
    return float(np.median(ok)), float(np.percentile(ok, 99))


def serve_dtype(args, dtype: str, rows: int, fp32: dict) -> dict:
    """One version of ``rows`` rows in ``dtype``, served by two PS processes and co-located; its
    lookups take turns with the float32 version's (served again beside it) in one window."""
    import model_store as ms
    from loadtest.bench_scale import wait_version
    from model_store.layout import set_current
    from serving.rpc.procs import stop_children

    base = Path(tempfile.mkdtemp(prefix=f"recserve-scale-{dtype}-", dir=args.dir or None))
    fp32_root = Path(args.dir) / "store"
    try:
        root = base / "store"
        t0 = time.perf_counter()
        version, sample = build_version(root, rows, seed=1, dtype=dtype)
        build_s = time.perf_counter() - t0
        set_current(root, MODEL, version)
        vdir = root / MODEL / version
        version_bytes = sum(f.stat().st_size for f in (vdir / "embeddings").rglob("*.npy"))
        print(f"built a {dtype} version of {rows:,} rows ({version_bytes / 1e9:.2f} GB) in {build_s:.1f} s")
        t_spawn = time.time()
        procs, clients = _serve(root / MODEL, base, dtype)
        base_procs, base_clients = _serve(fp32_root / MODEL, base, "float32")
        try:
            load_s = wait_version(clients, version) - t_spawn
            time.sleep(2)
            rss, pss = usage([p.pid for p in procs]).rss_bytes, pss_bytes([p.pid for p in procs])
            wait_version(base_clients, str(ms.current(fp32_root, MODEL)))
            calls: list = []
            base_calls: list = []
            stop = threading.Event()
            sides = [(clients, sample), (base_clients, np.load(Path(args.dir) / "sample.npy"))]
            looper = threading.Thread(
                target=paired_loop, args=(sides, args.rate, stop, [calls, base_calls]), daemon=True
            )
            looper.start()
            time.sleep(1 + 4 * args.window_s)
            stop.set()
            looper.join()
            wire = wire_figures(clients, sample, args.wire_calls)
        finally:
            for c in clients + base_clients:
                c.close()
            stop_children(procs + base_procs)
        (p50, p99), (base_p50, base_p99) = _figures(calls), _figures(base_calls)
        out = {
            "serving_rows": rows,
            "version_gb": round(version_bytes / 1e9, 3),
            "serving_bytes_per_row": round(rss / rows, 2),
            "serving_pss_bytes_per_row": round(pss / rows, 2),
            "load_s": round(load_s, 2),
            "lookup_calls": len(calls),
            "lookup_failures": sum(1 for c in calls if not c[2]),
            "lookup_p50_ms": round(p50, 3),
            "lookup_p99_ms": round(p99, 3),
            "fp32_same_window_p50_ms": round(base_p50, 3),
            "fp32_same_window_p99_ms": round(base_p99, 3),
            "lookup_p99_over_fp32": round(p99 / base_p99, 3),
            "lookup_p99_over_fp32_steady": round(p99 / fp32["lookup_p99_steady_ms"], 3),
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


def print_tables(result: dict) -> None:
    from loadtest.bench_scale import IDS_PER_CALL
    from loadtest.common import print_table

    for dtype in ("float16", "int8"):
        print_table(f"serving a {dtype} version", [result[dtype]], [k for k in result[dtype] if k != "wire"])
        wire = [{"asked": mode, **figures} for mode, figures in result[dtype]["wire"].items()]
        print_table(
            f"{dtype}: {IDS_PER_CALL}-ID lookups over gRPC, as stored or float32", wire, list(wire[0])
        )
    print(f"bytes per row over raw key + fp32 row: {result['bytes_per_row_ratio']} "
          f"(PSS: {result['pss_bytes_per_row_ratio']})")  # fmt: skip


def targets(r: dict) -> dict[str, bool]:
    if "int8" not in r:
        return {}
    return {
        "int8 bytes/row <= 0.45x raw key + fp32 row": r["bytes_per_row_ratio"]["int8"] <= 0.45,
        "float16 bytes/row <= 0.6x raw": r["bytes_per_row_ratio"]["float16"] <= 0.6,
        "int8 serving_rows >= 300M": r["int8"]["serving_rows"] >= 300_000_000,
        "int8 lookup p99 <= 1.2x the float32 version's (one window)": r["int8"]["lookup_p99_over_fp32"]
        <= 1.2,
        "no int8/float16 lookup failed": r["int8"]["lookup_failures"] + r["float16"]["lookup_failures"] == 0,
    }
