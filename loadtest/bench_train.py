"""``make bench-train``: the same DLRM trained three ways on the Criteo split (8k train / 2k test).

- ``inprocess``: embedding tables as a torch ``nn.EmbeddingBag`` in the trainer, no PS;
- ``sync``: rows on PS shards through the embedding worker, staleness K=0 (every sparse update
  applied before the next lookup);
- ``hybrid``: the same with K=4 (sparse updates overlap the next steps).

Same preprocessing, hyper-parameters and epochs (``TrainConfig`` defaults) for all three; each
figure is the mean over seeds 0, 1, 2 (per-seed lists alongside). ``samples_per_s`` counts
training rows over the training steps only (no data loading, evaluation, PS start-up or export).
The variants run interleaved (seed by seed) after one unrecorded warm-up run each, so that
one-off start-up costs and load from other processes on the machine spread over all three. Writes ``loadtest/results/train.json`` and prints a table.

    python -m loadtest.bench_train [--shards process|inprocess] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np

from training.config import TrainConfig
from training.train import train

RESULTS = Path(__file__).resolve().parent / "results" / "train.json"
VARIANTS: dict[str, dict[str, Any]] = {
    "inprocess": {"embeddings": "inprocess"},
    "sync": {"staleness": 0},
    "hybrid": {"staleness": 4},
}


def run_variant(name: str, seed: int, args: argparse.Namespace, **extra) -> dict:
    kw = dict(VARIANTS[name], seed=seed, export=False, progress=False, threads=args.threads)
    if name != "inprocess":
        kw |= {"inprocess_ps": args.shards == "inprocess", "num_shards": args.num_shards}
    if args.epochs:
        kw["epochs"] = args.epochs
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument(
        "--shards",
        choices=["process", "inprocess"],
        default="process",
        help="PS shards as `recserve ps` processes (gRPC) or in-process stores",
    )
    # one shard by default: on a 2-core machine a second PS process adds per-RPC CPU, not capacity
    p.add_argument("--num-shards", type=int, default=1)
    p.add_argument(
        "--threads", type=int, default=0, help="torch intra-op threads, all variants (0: TrainConfig's)"
    )
    p.add_argument("--epochs", type=int, default=0, help="0: the TrainConfig default")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    seeds = [int(s) for s in args.seeds.split(",")]

    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    load_before = os.getloadavg()
    t0 = time.time()
    # warm-up, not recorded: the first run in a process pays one-off costs (imports, kernel and
    # thread-pool start-up) that would otherwise land on whichever variant runs first
    for name in VARIANTS:
        run_variant(name, 99, args, epochs=1, limit=2048)
    for seed in seeds:
        for name in VARIANTS:
            r = run_variant(name, seed, args)
            runs[name].append(r)
            print(
                f"seed {seed} {name:9s} auc {r['auc']:.4f} logloss {r['logloss']:.4f} "
                f"{r['samples_per_s']:8.0f} samples/s",
                flush=True,
            )

    results = {name: summarise(rs) for name, rs in runs.items()}
    inproc, sync, hybrid = results["inprocess"], results["sync"], results["hybrid"]
    cfg = TrainConfig()
    results["conditions"] = {
        "data": "Criteo split: 8000 train / 2000 test rows (data/criteo/wide_resdnn_*)",
        "arch": "dlrm",
        "dim": cfg.dim,
        "epochs": args.epochs or cfg.epochs,
        "batch_size": cfg.batch_size,
        "sparse": f"{cfg.sparse_optimizer} lr {cfg.lr}",
        "dense": f"adam lr {cfg.dense_lr}",
        "seeds": seeds,
        "shards": f"{args.num_shards} x {'recserve ps process (gRPC)' if args.shards == 'process' else 'in-process store'}",
        "torch_threads": args.threads or max(1, (os.cpu_count() or 2) // 2),
        "cpus": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
        "loadavg_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "wall_s": round(time.time() - t0, 1),
    }
    results["targets"] = {
        "hybrid_auc_gt_0.70": hybrid["auc"] > 0.70,
        "hybrid_auc_ge_inprocess_minus_0.005": hybrid["auc"] >= inproc["auc"] - 0.005,
        "hybrid_speed_ge_0.5x_inprocess": hybrid["samples_per_s"] >= 0.5 * inproc["samples_per_s"],
        "hybrid_speed_ge_1.3x_sync": hybrid["samples_per_s"] >= 1.3 * sync["samples_per_s"],
        "hybrid_over_inprocess": round(hybrid["samples_per_s"] / inproc["samples_per_s"], 3),
        "hybrid_over_sync": round(hybrid["samples_per_s"] / sync["samples_per_s"], 3),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")

    print(f"\n{'variant':10s} {'AUC':>7s} {'logloss':>8s} {'samples/s':>10s}   AUC per seed")
    for name in VARIANTS:
        r = results[name]
        seeds_txt = " ".join(f"{a:.4f}" for a in r["auc_per_seed"])
        print(f"{name:10s} {r['auc']:7.4f} {r['logloss']:8.4f} {r['samples_per_s']:10.0f}   {seeds_txt}")
    print(f"\ntargets: {json.dumps(results['targets'])}")
    print(f"conditions: {json.dumps(results['conditions'])}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
