"""``make bench-scale-train``: training memory and throughput as the data grows (issue 11).

1. ``recserve synth`` writes training files of N and 10N rows (one seed: the small file is the
   start of the large one) and a held-out test file (another seed, same hidden model).
2. Each training file is streamed through ``recserve train --epochs 1`` in a subprocess, as a user
   types it; the peak RSS of its process tree (the trainer and the PS shard processes it starts)
   is sampled every 0.2 s (``loadtest.processes.run_sampled``; the trainer's own peak is the kernel's
   high-water mark). The shards get ``--capacity`` rows each, enough for every
   ID of the 10N file, so they never grow during the run (a full shard grows; none evicts).
   The PS holds one row per distinct ID, and synth data keeps bringing new IDs, so the PS share
   of the memory grows with the data by design; the trainer's share must not.
3. ``read_rows_per_s``: the 10N file -> CompactBatches on every core, measured alone, best of
   two: one process per core streams the file and transforms its rank's pieces, as data-parallel
   ranks read (``features.stream``'s ``part``: every process parses the whole text and keeps
   1024-row pieces i with i % processes == rank); ``read_rows_per_s_1proc``: the trainer's own
   path (one process: stream -> shuffle buffer -> batches of 128 rows).
4. The issue's baseline (reading a 1M-row Criteo TSV for training took 17.5 s and 4.7 GB RSS):
   the trainer's data path (dense-statistics pass + one shuffled epoch of 128-row batches) on 1M
   rows of synth TSV in a fresh process, time and peak RSS.

Writes ``loadtest/results/scale_train.json`` and prints a table. Linux only (/proc).

    python -m loadtest.bench_scale_train [--rows 200000] [--scale 1.0] [--capacity 4000000] [--quick]
                                         [--results-dir DIR]

``--quick``: 2,000 rows (20,000 for the reader baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from loadtest.common import ROOT, Stopwatch, parse, parser, print_table, write_results
from loadtest.processes import run_sampled

ISSUE_BASELINE = {"seconds": 17.5, "peak_rss_gb": 4.7, "rows": 1_000_000}


# ---- the steps ----------------------------------------------------------------------------------
def recserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "recserve", *args]


def synth(path: Path, rows: int, seed: int, scale: float) -> float:
    cmd = recserve(
        "synth", "--rows", str(rows), "--out", str(path), "--seed", str(seed), "--scale", str(scale)
    )
    with Stopwatch() as sw:
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    return rows / sw.s


def train(data: Path, test: Path, store: Path, args: argparse.Namespace) -> dict:
    cmd = recserve("train", "--data", str(data), "--test", str(test), "--epochs", "1")
    cmd += ["--capacity", str(args.capacity), "--num-shards", str(args.num_shards)]
    cmd += ["--store", str(store), "--model", data.stem, "--no-progress", "--log-level", "WARNING"]
    run = run_sampled(cmd, args.timeout)
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    shard_rows = [
        json.loads(m.read_text())["rows"] for m in Path(summary["version_dir"]).glob("embeddings/*/meta.json")
    ]
    return {
        "peak_rss_gb": run.peak_rss / 1e9,
        "trainer_peak_rss_gb": run.own_peak_rss / 1e9,
        "ps_rows": sum(shard_rows),
        "samples_per_s": summary["samples_per_s"],
        "auc": summary["auc"],
        "wall_s": summary["wall_s"],
    }


def _read_part(path: Path, rank: int, world: int) -> int:
    """Rows of rank ``rank`` of ``world`` streamed and transformed into CompactBatches."""
    from features.schema import load_schema
    from features.stream import ReadOptions, stream
    from features.transform import transform

    schema = load_schema(ROOT / "data/schemas/criteo.yaml")
    options = ReadOptions(numeric_dense=True)
    return sum(transform(t, schema).num_rows for t in stream(path, schema, options, part=(rank, world)))


def read_rate(path: Path, workers: int) -> dict:
    """Rows per second, file -> CompactBatches, in ``workers`` processes (one rank each)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(abs, range(workers)))  # start the workers before the clock
        with Stopwatch() as sw:
            rows = sum(pool.map(_read_part, [path] * workers, range(workers), [workers] * workers))
        return {"rows": rows, "rows_per_s": rows / sw.s}


def trainer_read(path: Path, limit: int) -> dict:
    """The trainer's data path alone (dense-statistics pass + one shuffled epoch of 128-row
    batches) in this process: rows, seconds, rows/s. Run in a fresh process for its peak RSS."""
    import resource

    import numpy as np

    from features.schema import load_schema
    from features.stream import ReadOptions
    from training import data

    with Stopwatch() as sw:
        schema = load_schema(ROOT / "data/schemas/criteo.yaml")
        split = data.Split(path, schema, ReadOptions(numeric_dense=True), limit)
        split.scan().stats(schema)  # the trainer's statistics pass (they go to its dense network)
        rows = sum(b.num_rows for b in split.batches(128, 65536, np.random.default_rng(0)))
    seconds = sw.s
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
    return {"rows": rows, "seconds": seconds, "rows_per_s": rows / seconds, "peak_rss_gb": peak}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--rows", type=int, default=200_000, help="N: rows of the small training file")
    p.add_argument("--test-rows", type=int, default=50_000, help="rows of the held-out test file")
    p.add_argument("--scale", type=float, default=1.0, help="synth cardinality scale (1: Kaggle's)")
    p.add_argument("--capacity", type=int, default=4_000_000, help="initial rows per PS shard (no growth)")
    p.add_argument("--num-shards", type=int, default=2)
    p.add_argument("--baseline-rows", type=int, default=1_000_000, help="rows for the reader baseline")
    p.add_argument("--workdir", help="where the data goes (default: a temporary directory, removed)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per training run")
    p.add_argument("--read-runs", type=int, default=2, help="read_rows_per_s: the best of this many")
    p.add_argument("--trainer-read", nargs=2, metavar=("FILE", "LIMIT"), help=argparse.SUPPRESS)
    quick = {"rows": 2000, "test_rows": 500, "capacity": 100_000, "baseline_rows": 20_000, "read_runs": 1}
    args = parse(p, argv, quick)
    if args.trainer_read:  # the child of step 4
        print(json.dumps(trainer_read(Path(args.trainer_read[0]), int(args.trainer_read[1]))))
        return 0

    work = Path(args.workdir or tempfile.mkdtemp(prefix="recserve-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()
    n = args.rows
    try:
        small, large, test = work / "train_1x.tsv", work / "train_10x.tsv", work / "test.tsv"
        synth_rate = synth(large, 10 * n, seed=1, scale=args.scale)
        synth(small, n, seed=1, scale=args.scale)
        synth(test, args.test_rows, seed=2, scale=args.scale)
        baseline_file = large if 10 * n >= args.baseline_rows else work / "baseline.tsv"
        if baseline_file != large:
            synth(baseline_file, args.baseline_rows, seed=1, scale=args.scale)

        runs, loads = {}, {}
        for name, path in (("1x", small), ("10x", large)):
            loads[f"train_{name}"] = round(os.getloadavg()[0], 2)
            runs[name] = train(path, test, work / "store", args)
        loads["read"] = round(os.getloadavg()[0], 2)
        # best of two: the machine may be shared, and a rate is a capability
        read = max(
            (read_rate(large, os.cpu_count() or 1) for _ in range(args.read_runs)),
            key=lambda r: r["rows_per_s"],
        )
        loads["reader_baseline"] = round(os.getloadavg()[0], 2)
        child = run_sampled(
            [sys.executable, "-m", "loadtest.bench_scale_train", "--trainer-read", str(baseline_file), str(args.baseline_rows)],
            args.timeout,
        )  # fmt: skip
        reader = json.loads(child.stdout.strip().splitlines()[-1])
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    one, ten = runs["1x"], runs["10x"]
    results = {
        "train_peak_rss_gb_1x": round(one["peak_rss_gb"], 3),
        "train_peak_rss_gb_10x": round(ten["peak_rss_gb"], 3),
        "rss_ratio_10x": round(ten["peak_rss_gb"] / one["peak_rss_gb"], 3),
        "trainer_peak_rss_gb_1x": round(one["trainer_peak_rss_gb"], 3),
        "trainer_peak_rss_gb_10x": round(ten["trainer_peak_rss_gb"], 3),
        "trainer_rss_ratio_10x": round(ten["trainer_peak_rss_gb"] / one["trainer_peak_rss_gb"], 3),
        "ps_rows_1x": one["ps_rows"],
        "ps_rows_10x": ten["ps_rows"],
        "train_samples_per_s": round(ten["samples_per_s"], 1),
        "train_samples_per_s_1x": round(one["samples_per_s"], 1),
        "test_auc": ten["auc"],
        "test_auc_1x": one["auc"],
        "read_rows_per_s": round(read["rows_per_s"]),
        "read_rows_per_s_1proc": round(reader["rows_per_s"]),
        "reader_baseline_s": round(reader["seconds"], 2),
        "reader_baseline_peak_rss_gb": round(child.peak_rss / 1e9, 3),
        "issue_baseline": ISSUE_BASELINE,
        "synth_rows_per_s": round(synth_rate),
        "targets": {"rss_ratio_10x": "<= 1.25", "read_rows_per_s": ">= 250000"},
        "conditions": {
            "rows_1x": n,
            "rows_10x": 10 * n,
            "test_rows": args.test_rows,
            "scale": args.scale,
            "capacity_per_shard": args.capacity,
            "num_shards": args.num_shards,
            "epochs": 1,
            "read_workers": os.cpu_count(),
            "baseline_rows": args.baseline_rows,
            "load_average_at_start": [round(x, 2) for x in load],
            "load_average_1min_before": loads,
        },
    }
    rows = [
        {"run": "1x", "rows": n, "peak_rss_gb": one["peak_rss_gb"], "trainer_gb": one["trainer_peak_rss_gb"],
         "ps_rows": one["ps_rows"], "samples_per_s": one["samples_per_s"], "test_auc": one["auc"]},
        {"run": "10x", "rows": 10 * n, "peak_rss_gb": ten["peak_rss_gb"], "trainer_gb": ten["trainer_peak_rss_gb"],
         "ps_rows": ten["ps_rows"], "samples_per_s": ten["samples_per_s"], "test_auc": ten["auc"]},
    ]  # fmt: skip
    print_table(
        "recserve train, streamed (peak RSS of the process tree: trainer + PS shards)", rows, list(rows[0])
    )
    print_table(
        "reading",
        [
            {"what": f"file -> CompactBatch, {os.cpu_count()} processes", "rows_per_s": read["rows_per_s"]},
            {
                "what": "trainer's path, 1 process (stats pass + shuffled 128-row batches)",
                "rows_per_s": reader["rows_per_s"],
            },
            {
                "what": f"{args.baseline_rows:,} rows for training: seconds / peak RSS GB",
                "rows_per_s": f"{reader['seconds']:.1f} s / {child.peak_rss / 1e9:.2f} GB (issue: 17.5 s / 4.7 GB)",
            },
        ],  # fmt: skip
        ["what", "rows_per_s"],
    )
    print(f"\nwrote {write_results('scale_train', results, args.results_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
