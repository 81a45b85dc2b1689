"""``make bench-scale``: serving a 50M-row version from memory-mapped files, and training at scale.

Serving (this module):

1. Two versions of ``--rows`` rows (default 50M), dim 16, over 2 shards are written straight into a
   model store with random signs and rows (``model_store.shards.write_shard``: bucket order, the
   manifest's checksums; nothing is trained), sealed, and v1 published.
2. One ``recserve ps --follow <store>/<model> --shard i --num-shards 2`` per shard, as ``recserve up``
   starts them. ``load_s``: spawn -> every shard serves v1 (its files mapped and verified);
   ``load_gb_per_s``: the version's bytes / load_s. ``serving_bytes_per_row``: summed VmRSS of
   the PS processes / rows, against ``raw_bytes_per_row`` = 8 + 4 x dim.
3. A client sends 4,000-ID ``Lookup`` calls (random signs of the version, one shard after the other)
   at ``--rate`` calls/s for ``--steady-s`` seconds (``lookup_p99_steady_ms``), then v2 is published
   with ``nice -n 10 recserve publish`` (the one gate: XXH3-128 of every file) while the loop goes on:
   ``switch_s`` (publish -> every shard answers from v2), ``lookup_p99_during_switch_ms`` (calls
   from the publish until 2 s after the last shard flipped), ``peak_rss_during_switch_gb`` (VmRSS
   polled every 50 ms) against ``old_plus_new_gb`` (steady RSS on v1 + steady RSS on v2).
4. ``delta_rows_per_s``: a delta of ``--delta-rows`` rows per shard is written into v2; rows /
   (its _SUCCESS -> every shard reports its seq).

Training: ``loadtest.bench_scale_train`` (synth files of N and 10N rows streamed through
``recserve train``) runs after, unless ``--no-train``; its keys are merged in.

Writes ``loadtest/results/scale.json`` and ``scale.png`` (lookup latency over time, the switch
marked). Linux only (/proc). Needs ~2 x 3.6 GB of disk and ~10 GB of RAM at the default size.

    python -m loadtest.bench_scale [--rows 50000000] [--dir /tmp/scale [--keep] [--reuse]] [--no-train]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from features.hashing import unique_signs
from loadtest.common import machine, print_table, write_results

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "loadtest" / "results"
MODEL = "scale"
DIM = 16
SHARDS = 2
IDS_PER_CALL = 4000


# ---- building versions ----------------------------------------------------------------------
def _shard_data(kind: str, shard: int, version: str, signs: np.ndarray, rows: np.ndarray):
    from model_store.shards import ShardData

    n = len(signs)
    meta = {"kind": kind, "shard": shard, "num_shards": SHARDS, "dim": DIM, "dtype": "float32",
            "optimizer": {"name": "adagrad"}, "state": [], "schema_hash": "", "version": version,
            "delta_seq": 0 if kind == "delta" else -1, "step": 0}  # fmt: skip
    if kind == "delta":
        meta["base_version"] = version
    return ShardData(meta, signs, rows, {}, np.zeros(n, np.uint32), np.zeros(n, np.uint32))


def shard_signs(rows: int, shard: int, seed: int) -> np.ndarray:
    """~rows/SHARDS distinct random signs that route to ``shard``."""
    from features.hashing import shard_of

    rng = np.random.default_rng(seed * 1000 + shard)
    out = []
    need = rows // SHARDS
    while need > 0:
        s = unique_signs(rng.integers(1, 2**63, int(need * SHARDS * 1.05), dtype=np.uint64))
        s = s[shard_of(s, SHARDS) == shard]
        out.append(s[:need])
        need -= len(out[-1])
    signs = unique_signs(np.concatenate(out))
    return signs


def build_version(root: Path, rows: int, seed: int) -> tuple[str, np.ndarray]:
    """A sealed version of random rows; returns its name and a sample of its signs."""
    import model_store as ms

    version = ms.next_version(root, MODEL)
    staging = ms.staging_dir(root, MODEL, version)
    sample = []
    for shard in range(SHARDS):
        signs = shard_signs(rows, shard, seed=1)  # the same signs in every version, new rows
        rng = np.random.default_rng(seed * 1000 + shard)
        n = len(signs)
        data = _shard_data("full", shard, version, signs, rng.standard_normal((n, DIM), dtype=np.float32))
        ms.shards.write_shard(staging / "embeddings", data)
        sample.append(signs[rng.integers(0, n, 200_000)])
        del data, signs
    ms.write_manifest(staging, {"model": MODEL, "version": version, "schema_fingerprint": "scale",
                                "dim": DIM, "num_shards": SHARDS})  # fmt: skip
    ms.seal(staging, ms.version_dir(root, MODEL, version))
    return version, np.concatenate(sample)


def write_delta(root: Path, version: str, sample: np.ndarray, rows: int) -> Path:
    import model_store as ms
    from features.hashing import shard_of

    vdir = ms.version_dir(root, MODEL, version)
    ddir = ms.delta_dir(vdir, 0)
    rng = np.random.default_rng(7)
    for shard in range(SHARDS):
        mine = unique_signs(sample[shard_of(sample, SHARDS) == shard])
        extra = rng.integers(1, 2**63, rows, dtype=np.uint64)
        signs = unique_signs(np.concatenate([mine, extra[shard_of(extra, SHARDS) == shard]]))[:rows]
        rows_ = np.full((len(signs), DIM), 0.5, np.float32)
        ms.shards.write_shard(ddir, _shard_data("delta", shard, version, signs, rows_))
    ms.mark_done(ddir)
    return ddir


def _reuse(root: Path, rows: int):
    """(v1, v2, sample) of a store an earlier ``--keep`` run built with ``rows`` rows, reset to
    v1 published and v2 without deltas; None when there is none."""
    import model_store as ms

    sample = root.parent / "sample.npy"
    meta = sorted((root / MODEL).glob("[12]/embeddings/*/meta.json"))
    if not sample.exists() or len(meta) != 2 * SHARDS:
        return None
    if sum(json.loads(m.read_text())["rows"] for m in meta) != 2 * rows // SHARDS * SHARDS:
        return None
    shutil.rmtree(ms.version_dir(root, MODEL, "2") / ms.DELTAS, ignore_errors=True)
    return "1", "2", np.load(sample)


# ---- processes --------------------------------------------------------------------------------
def rss(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


class Sampler(threading.Thread):
    """Polls the PS processes' RSS every 50 ms."""

    def __init__(self, pids):
        super().__init__(daemon=True)
        self.pids, self.samples, self.stop = pids, [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            self.samples.append((time.time(), rss(self.pids)))
            time.sleep(0.05)


def wait_version(clients, version: str, seq: int = -1, timeout_s: float = 600.0) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout_s:
        try:
            st = [c.stats(timeout_s=2) for c in clients]
            if all(s["version"] == version and s["delta_seq"] >= seq for s in st):
                return time.time()
        except Exception:
            pass
        time.sleep(0.02)
    raise TimeoutError(f"shards did not serve version {version} (seq {seq}) in {timeout_s}s")


def lookup_loop(clients, sample, rate, stop, out):
    """4,000-ID lookups at ``rate`` calls/s (open loop: a late call does not delay the schedule)."""
    rng = np.random.default_rng(3)
    from features.hashing import shard_of

    owner = shard_of(sample, SHARDS)
    by_shard = [sample[owner == i] for i in range(SHARDS)]
    period, k = 1.0 / rate, 0
    t_next = time.time()
    while not stop.is_set():
        shard = k % SHARDS
        ids = by_shard[shard][rng.integers(0, len(by_shard[shard]), IDS_PER_CALL)]
        t0 = time.time()
        try:
            rows, misses = clients[shard].lookup(ids, timeout_s=5)
            ok, version = misses == 0, clients[shard].version
        except Exception:
            ok, version = False, None
        out.append((t0, time.time() - t0, ok, version))
        k += 1
        t_next += period
        delay = t_next - time.time()
        if delay > 0:
            time.sleep(delay)


def p99(values) -> float:
    return float(np.percentile(values, 99)) if len(values) else float("nan")


def run(args) -> dict:
    import model_store as ms
    from model_store.layout import set_current
    from serving.ps.client import PSClient
    from serving.rpc.procs import free_ports, spawn, stop_children

    base = Path(args.dir or tempfile.mkdtemp(prefix="recserve-scale-"))
    root = base / "store"
    t0 = time.perf_counter()
    if args.reuse and (reused := _reuse(root, args.rows)):
        v1, v2, sample = reused
    else:
        shutil.rmtree(root, ignore_errors=True)
        v1, sample = build_version(root, args.rows, seed=1)
        v2, _ = build_version(root, args.rows, seed=2)
        np.save(base / "sample.npy", sample)
    build_s = time.perf_counter() - t0
    set_current(root, MODEL, v1)
    version_bytes = sum(f.stat().st_size for f in (root / MODEL / v1 / "embeddings").rglob("*.npy"))
    rows = sum(
        json.loads(m.read_text())["rows"] for m in (root / MODEL / v1 / "embeddings").glob("*/meta.json")
    )
    print(
        f"built 2 versions of {rows:,} rows ({version_bytes / 1e9:.2f} GB each) in {base}; first in {build_s:.1f} s"
    )
    subprocess.run(["sync"], check=False)

    ports = free_ports(SHARDS)
    procs = []
    t_spawn = time.time()
    for i, port in enumerate(ports):
        procs.append(spawn(["ps", "--follow", str(root / MODEL), "--shard", str(i), "--num-shards",
                            str(SHARDS), "--dim", str(DIM), "--port", str(port), "--poll-s", "0.2"],
                           base / f"ps{i}.log"))  # fmt: skip
    pids = [p.pid for p in procs]
    clients = [PSClient(f"127.0.0.1:{p}", timeout_s=5) for p in ports]
    try:
        t_loaded = wait_version(clients, v1)
        load_s = t_loaded - t_spawn
        time.sleep(2)
        rss_v1 = rss(pids)
        calls: list = []
        stop = threading.Event()
        looper = threading.Thread(
            target=lookup_loop, args=(clients, sample, args.rate, stop, calls), daemon=True
        )
        looper.start()
        time.sleep(args.steady_s)
        sampler = Sampler(pids)
        sampler.start()
        t_publish = time.time()
        # as an operator would: `recserve publish` (the gate re-hashes every file) in its own
        # process, niced so that its checksum pass competes less with the lookups on a small machine
        subprocess.run(["nice", "-n", "10", sys.executable, "-m", "recserve", "publish", "--store", str(root),
                        "--model", MODEL, v2], cwd=ROOT, check=True, capture_output=True)  # fmt: skip
        t_switched = wait_version(clients, v2)
        time.sleep(2)
        t_end_switch = time.time()
        sampler.stop.set()
        time.sleep(args.steady_s / 2)
        stop.set()
        looper.join()
        rss_v2 = rss(pids)
        ddir = write_delta(root, v2, sample, args.delta_rows)
        t_delta = wait_version(clients, v2, seq=0)
        delta_s = t_delta - (ddir / ms.SUCCESS).stat().st_mtime
    finally:
        for c in clients:
            c.close()
        stop_children(procs)
    steady = [d for t, d, ok, _ in calls if t < t_publish and ok]
    during = [d for t, d, ok, _ in calls if t_publish <= t <= t_end_switch]
    failures = sum(1 for _, _, ok, _ in calls if not ok)
    peak = max((r for _, r in sampler.samples), default=0)
    result = {
        "serving_rows": rows,
        "dim": DIM,
        "shards": SHARDS,
        "version_gb": round(version_bytes / 1e9, 3),
        "raw_bytes_per_row": 8 + 4 * DIM,
        "serving_bytes_per_row": round(rss_v1 / rows, 2),
        "serving_rss_gb": round(rss_v1 / 1e9, 3),
        "load_s": round(load_s, 2),
        "load_gb_per_s": round(version_bytes / 1e9 / load_s, 2),
        "switch_s": round(t_switched - t_publish, 2),
        "lookup_rate_per_s": args.rate,
        "lookup_ids_per_call": IDS_PER_CALL,
        "lookup_calls": len(calls),
        "lookup_failures": failures,
        "lookup_p50_steady_ms": round(float(np.median(steady)) * 1e3, 3),
        "lookup_p99_steady_ms": round(p99(steady) * 1e3, 3),
        "lookup_p99_during_switch_ms": round(p99(during) * 1e3, 3),
        "lookup_calls_during_switch": len(during),
        "peak_rss_during_switch_gb": round(peak / 1e9, 3),
        "old_plus_new_gb": round((rss_v1 + rss_v2) / 1e9, 3),
        "delta_rows": args.delta_rows * SHARDS,
        "delta_visible_s": round(delta_s, 3),
        "delta_rows_per_s": round(args.delta_rows * SHARDS / max(delta_s, 1e-9)),
    }
    windows = []  # p99 per second around the switch: where does the time go?
    for k in range(-2, int(t_end_switch - t_publish) + 2):
        w = [d for t, d, ok, _ in calls if t_publish + k <= t < t_publish + k + 1]
        if w:
            windows.append({"from_publish_s": k, "calls": len(w), "p99_ms": round(p99(w) * 1e3, 2)})
    result["lookup_p99_per_second_around_switch"] = windows
    plot(calls, t_publish, t_switched, RESULTS / "scale.png")
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return result


def plot(calls, t_publish, t_switched, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = calls[0][0]
    ts = np.array([c[0] - t0 for c in calls])
    ms_ = np.array([c[1] * 1e3 for c in calls])
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.plot(ts, ms_, ".", markersize=2, label=f"{IDS_PER_CALL}-ID Lookup latency")
    ax.axvspan(
        t_publish - t0, t_switched - t0, color="orange", alpha=0.3, label="publish -> all shards on v2"
    )
    ax.set_xlabel("seconds")
    ax.set_ylabel("ms")
    ax.set_title("PS lookups while a second 50M-row version is published")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=50_000_000, help="rows per version (over 2 shards)")
    p.add_argument("--rate", type=float, default=200.0, help="lookup calls per second")
    p.add_argument("--steady-s", type=float, default=10.0, help="seconds of steady lookups before the switch")
    p.add_argument("--delta-rows", type=int, default=1_000_000, help="rows per shard in the delta")
    p.add_argument("--dir", default="", help="working directory (default: a temp dir, removed after)")
    p.add_argument("--keep", action="store_true", help="keep the working directory")
    p.add_argument(
        "--reuse", action="store_true", help="with --dir: serve the versions an earlier --keep run built"
    )
    p.add_argument("--no-train", action="store_true", help="skip the training part")
    p.add_argument("--train-args", default="", help="extra arguments for loadtest.bench_scale_train")
    p.add_argument("--train-json", default="", help="merge this scale_train.json instead of running it")
    args = p.parse_args(argv)
    result = {"machine": machine(), "serving": run(args)}
    serving = result["serving"]
    print_table("serving a memory-mapped version", [serving], list(serving))
    if args.train_json:
        result["training"] = json.loads(Path(args.train_json).read_text())
    elif not args.no_train:
        cmd = [sys.executable, "-m", "loadtest.bench_scale_train", *args.train_args.split()]
        subprocess.run(cmd, cwd=ROOT, check=True)
        result["training"] = json.loads((RESULTS / "scale_train.json").read_text())
    flat = dict(serving)
    for k, v in result.get("training", {}).items():
        if not isinstance(v, dict):
            flat.setdefault(k, v)
    result.update(flat)
    write_results("scale", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
