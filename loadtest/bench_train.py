"""``make bench-train``: the same DLRM trained several ways; two sections in one JSON.

``criteo`` (the 8k/2k Criteo split, each figure the mean over seeds 0, 1, 2, the variants
interleaved after one unrecorded warm-up run each):

- ``inprocess``: embedding tables as a torch ``nn.EmbeddingBag`` in the trainer, no PS;
- ``sync``: every table on the PS shards (``--sharding ps``), staleness K=0;
- ``hybrid``: the same with K=4 (sparse updates overlap the next steps).

``synth_1m`` (``recserve synth``: 1M training rows, a 100k test file, one epoch, batch 128; every
variant a ``recserve train`` process of its own, or the peer's, in the same invocation):

- ``peer``: DLRM as a user writes it in plain PyTorch (``loadtest/peer_dlrm.py``);
- ``inprocess``, ``sync``, ``hybrid``: as above;
- ``planned``: ``--sharding auto`` with ample memory (every table fits: all replicated);
- ``planned_half``: ``--sharding auto`` with a budget that holds half the embedding bytes.

Each data set also gets a ``quantized`` section (``loadtest/bench_quant.py``): one more run
exported in float32, its test AUC (``float32_auc``) and, with its tables served in float16 and in
int8, each one's ``auc`` and ``max_abs_score_diff``. ``--sections quantized`` measures only those
(for both data sets), keeping the rest of the JSON.

``samples_per_s`` counts training rows over the training loop only; ``wall_s`` is the whole
process (reading, planning, PS start, evaluation); ``peak_rss_gb`` is the trainer process's
(PS processes apart). Writes ``loadtest/results/train.json`` and prints tables.

    python -m loadtest.bench_train [--sections criteo,synth_1m,quantized] [--shards process|inprocess] [--quick]
                                   [--results-dir DIR]

``--quick``: one seed on the first 2,048 Criteo rows and no warm-up runs, 2,000 synth rows.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from features.schema import load_schema
from features.stream import ReadOptions
from loadtest import bench_quant
from loadtest.common import Stopwatch, parse, parser
from loadtest.processes import run_sampled
from training.config import TrainConfig
from training.train import train

VARIANTS: dict[str, dict[str, Any]] = {
    "inprocess": {"embeddings": "inprocess"},
    "sync": {"sharding": "ps", "staleness": 0},
    "hybrid": {"sharding": "ps", "staleness": 4},
}
SYNTH_VARIANTS: dict[str, list[str]] = {
    "inprocess": ["--embeddings", "inprocess"],
    "sync": ["--sharding", "ps", "--staleness", "0"],
    "hybrid": ["--sharding", "ps", "--staleness", "4"],
    "planned": ["--sharding", "auto"],  # --memory-gb: ample, set below
    "planned_half": ["--sharding", "auto"],  # --memory-gb: half the embedding bytes, set below
}


def run_variant(name: str, seed: int, args: argparse.Namespace, **extra) -> dict:
    kw = dict(VARIANTS[name], seed=seed, export=False, progress=False, threads=args.threads)
    if name != "inprocess":
        kw |= {"inprocess_ps": args.shards == "inprocess", "num_shards": args.num_shards}
    if args.epochs:
        kw["epochs"] = args.epochs
    if args.limit:
        kw["limit"] = args.limit
    r = train(TrainConfig(**(kw | extra)))
    return {"auc": r.auc, "logloss": r.logloss, "samples_per_s": r.samples_per_s, "train_s": r.train_seconds}


def summarise(runs: list[dict]) -> dict:
    out: dict[str, Any] = {}
    for key in ("auc", "logloss", "samples_per_s"):
        values = [r[key] for r in runs]
        out[key] = float(np.mean(values))
        out[f"{key}_per_seed"] = [round(v, 5) for v in values]
    out["auc_spread"] = float(np.max(out["auc_per_seed"]) - np.min(out["auc_per_seed"]))
    return out


def criteo_section(args: argparse.Namespace) -> dict:
    """The Criteo split, seeds interleaved after a warm-up run of each variant."""
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    load_before = os.getloadavg()
    sw = Stopwatch()
    # warm-up, not recorded: the first run in a process pays one-off costs (imports, kernel and
    # thread-pool start-up) that would otherwise land on whichever variant runs first
    for name in VARIANTS if args.warmup else ():
        run_variant(name, 99, args, epochs=1, limit=2048)
    for seed in seeds:
        for name in VARIANTS:
            r = run_variant(name, seed, args)
            runs[name].append(r)
            print(
                f"criteo seed {seed} {name:9s} auc {r['auc']:.4f} logloss {r['logloss']:.4f} "
                f"{r['samples_per_s']:8.0f} samples/s",
                flush=True,
            )

    results: dict[str, Any] = {name: summarise(rs) for name, rs in runs.items()}
    inproc, sync, hybrid = results["inprocess"], results["sync"], results["hybrid"]
    cfg = TrainConfig()
    results["conditions"] = {
        "data": "Criteo split: 8000 train / 2000 test rows (data/criteo/wide_resdnn_*)",
        "arch": "dlrm",
        "dim": cfg.table.dim,
        "epochs": args.epochs or cfg.epochs,
        "batch_size": cfg.batch_size,
        "sparse": f"{cfg.table.optimizer.name} lr {cfg.table.optimizer.lr}",
        "dense": f"adam lr {cfg.dense_lr}",
        "seeds": seeds,
        "shards": f"{args.num_shards} x {'recserve ps process (gRPC)' if args.shards == 'process' else 'in-process store'}",
        "torch_threads": args.threads or max(1, (os.cpu_count() or 2) // 2),
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(sw.s, 1),
    }
    results["targets"] = {
        "hybrid_auc_gt_0.70": hybrid["auc"] > 0.70,
        "hybrid_auc_ge_inprocess_minus_0.005": hybrid["auc"] >= inproc["auc"] - 0.005,
        "hybrid_over_inprocess": round(hybrid["samples_per_s"] / inproc["samples_per_s"], 3),
        "hybrid_over_sync": round(hybrid["samples_per_s"] / sync["samples_per_s"], 3),
    }
    print(f"\n{'criteo':10s} {'AUC':>7s} {'logloss':>8s} {'samples/s':>10s}   AUC per seed")
    for name in VARIANTS:
        r = results[name]
        seeds_txt = " ".join(f"{a:.4f}" for a in r["auc_per_seed"])
        print(f"{name:10s} {r['auc']:7.4f} {r['logloss']:8.4f} {r['samples_per_s']:10.0f}   {seeds_txt}")
    print(f"targets: {json.dumps(results['targets'])}")
    results["quantized"] = criteo_quantized(args)
    return results


def criteo_quantized(args: argparse.Namespace) -> dict:
    """The Criteo split's ``quantized`` section (seed 0, in-process PS)."""
    cfg, kw = TrainConfig(), {"seed": 0, "threads": args.threads}
    kw |= {"epochs": args.epochs} if args.epochs else {}
    kw |= {"limit": args.limit} if args.limit else {}
    with tempfile.TemporaryDirectory() as store:
        q = bench_quant.quantized_section(cfg.data, cfg.test, Path(store), **kw)
    bench_quant.show("criteo", q)
    return q


def synth_quantized(args: argparse.Namespace) -> dict:
    """The synth data's ``quantized`` section (one epoch, batch 128, in-process PS)."""
    train_file, test_file = synth_data(args.synth_rows, Path(args.synth_dir))
    with tempfile.TemporaryDirectory() as store:
        q = bench_quant.quantized_section(
            train_file, test_file, Path(store), epochs=1, batch_size=128, threads=args.threads, seed=0
        )
    bench_quant.show("synth_1m", q)
    return q


def _child(cmd: list[str]) -> dict:
    """Run one variant as its own process: its JSON summary plus its peak RSS (the kernel's
    high-water mark of that process alone)."""
    done = run_sampled(cmd, timeout_s=7200)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    summary["peak_rss_gb"] = round(done.own_peak_rss / (1 << 30), 3)
    return summary


def synth_data(rows: int, where: Path) -> tuple[Path, Path]:
    """``recserve synth`` training and test files (made once, then reused)."""
    where.mkdir(parents=True, exist_ok=True)
    files = (where / f"train-{rows}.tsv", where / f"test-{rows // 10}.tsv")
    for path, n, seed in ((files[0], rows, 1), (files[1], rows // 10, 2)):
        if not path.exists():
            tmp = path.with_suffix(".part.tsv")
            subprocess.run([sys.executable, "-m", "recserve", "synth", "--rows", str(n), "--out", str(tmp),
                            "--seed", str(seed), "--log-level", "WARNING"], check=True)  # fmt: skip
            tmp.rename(path)
    return files


def synth_section(args: argparse.Namespace) -> dict:
    """1M synth rows, one epoch: the peer and every recserve variant, each a process of its own."""
    from training.planning import planner
    from training.planning.costs import Costs

    train_file, test_file = synth_data(args.synth_rows, Path(args.synth_dir))
    sw = Stopwatch()
    load_before = os.getloadavg()
    schema = load_schema("data/schemas/criteo.yaml")
    total = sum(  # what every table takes in a store: the planner's own sizes
        t.bytes
        for t in planner.plan_tables(
            planner.table_stats(
                planner.sample(train_file, schema, ReadOptions(numeric_dense=True), 128, 100_000),
                schema, args.synth_rows,
            ),
            TrainConfig().store_config(schema.fingerprint), Costs(), 0.0,
        ).tables.values()
    )  # fmt: skip
    half_gb = total / 2 / (1 << 30)
    memory = {"planned": ["--memory-gb", "16"], "planned_half": ["--memory-gb", f"{half_gb:.4f}"]}
    base = [sys.executable, "-m", "recserve", "train", "--data", str(train_file), "--test", str(test_file),
            "--epochs", "1", "--no-export", "--no-progress", "--num-shards", str(args.num_shards),
            "--log-level", "WARNING"]  # fmt: skip
    if args.threads:
        base += ["--threads", str(args.threads)]
    results: dict[str, Any] = {}
    peer = [sys.executable, "-m", "loadtest.peer_dlrm", "--train", str(train_file), "--test", str(test_file),
            "--threads", str(args.threads or max(1, (os.cpu_count() or 2) // 2))]  # fmt: skip
    for name, cmd in [("peer", peer)] + [
        (n, base + f + memory.get(n, [])) for n, f in SYNTH_VARIANTS.items()
    ]:
        r = _child(cmd)
        results[name] = {k: r[k] for k in ("auc", "logloss", "samples_per_s", "wall_s", "peak_rss_gb")}
        print(f"synth_1m {name:12s} auc {r['auc']:.4f} {r['samples_per_s']:8.0f} samples/s "
              f"wall {r['wall_s']:6.1f} s rss {r['peak_rss_gb']:.2f} GB", flush=True)  # fmt: skip
    sps = {n: r["samples_per_s"] for n, r in results.items()}
    results["conditions"] = {
        "data": f"recserve synth: {args.synth_rows:,} train rows (seed 1), {args.synth_rows // 10:,} test (seed 2)",
        "epochs": 1, "batch_size": 128, "dim": 16, "shards": f"{args.num_shards} x recserve ps process",
        "embedding_bytes": total, "planned_half_memory_gb": round(half_gb, 4), "cpus": os.cpu_count(),
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(sw.s, 1),
    }  # fmt: skip
    results["targets"] = {
        "planned_over_peer": round(sps["planned"] / sps["peer"], 3),
        "planned_ge_1.3x_peer": sps["planned"] >= 1.3 * sps["peer"],
        "planned_auc_ge_peer_minus_0.005": results["planned"]["auc"] >= results["peer"]["auc"] - 0.005,
        "planned_over_inprocess": round(sps["planned"] / sps["inprocess"], 3),
        "planned_ge_0.9x_inprocess": sps["planned"] >= 0.9 * sps["inprocess"],
        "hybrid_over_sync": round(sps["hybrid"] / sps["sync"], 3),
        "hybrid_ge_1.3x_sync": sps["hybrid"] >= 1.3 * sps["sync"],
        "planned_half_over_hybrid": round(sps["planned_half"] / sps["hybrid"], 3),
        "planned_half_ge_1.2x_hybrid": sps["planned_half"] >= 1.2 * sps["hybrid"],
    }
    print(f"\n{'synth_1m':12s} {'AUC':>7s} {'samples/s':>10s} {'wall s':>7s} {'RSS GB':>7s}")
    for name in ["peer", *SYNTH_VARIANTS]:
        r = results[name]
        print(
            f"{name:12s} {r['auc']:7.4f} {r['samples_per_s']:10.0f} {r['wall_s']:7.1f} {r['peak_rss_gb']:7.2f}"
        )
    print(f"targets: {json.dumps(results['targets'])}")
    results["quantized"] = synth_quantized(args)
    return results


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument(
        "--sections", default="criteo,synth_1m", help="comma-separated: criteo, synth_1m, quantized (only)"
    )
    p.add_argument("--seeds", default="0,1,2", help="criteo: seeds per variant")
    p.add_argument(
        "--shards",
        choices=["process", "inprocess"],
        default="process",
        help="criteo: PS shards as `recserve ps` processes (gRPC) or in-process stores",
    )
    # one shard by default: on a 2-core machine a second PS process adds per-RPC CPU, not capacity
    p.add_argument("--num-shards", type=int, default=1)
    p.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads, all variants (0: TrainConfig's)"
    )
    p.add_argument("--epochs", type=int, default=0, help="criteo: 0 is the TrainConfig default")
    p.add_argument("--limit", type=int, default=0, help="criteo: training rows per run (0: all)")
    p.add_argument(
        "--no-warmup", dest="warmup", action="store_false", help="criteo: no unrecorded warm-up runs"
    )
    p.add_argument("--synth-rows", type=int, default=1_000_000, help="synth_1m: training rows")
    p.add_argument("--synth-dir", default=str(Path(tempfile.gettempdir()) / "recserve-bench-synth"))
    args = parse(p, argv, {"seeds": "0", "epochs": 1, "limit": 2048, "warmup": False, "synth_rows": 2000})
    logging.basicConfig(level=logging.WARNING)
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - {"criteo", "synth_1m", "quantized"}
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}")
    out = args.results_dir / "train.json"
    results = json.loads(out.read_text()) if out.exists() else {}
    results = {k: v for k, v in results.items() if k in ("criteo", "synth_1m")}  # an older layout goes
    if "criteo" in sections:
        results["criteo"] = criteo_section(args)
    if "synth_1m" in sections:
        results["synth_1m"] = synth_section(args)
    if "quantized" in sections:  # the quantized figures alone, beside the data sets' other figures
        for name, measure in (("criteo", criteo_quantized), ("synth_1m", synth_quantized)):
            if name not in sections:
                results.setdefault(name, {})["quantized"] = measure(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
