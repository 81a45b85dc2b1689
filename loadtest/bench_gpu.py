"""``make bench-gpu``: the dense half on a GPU -- serving and heterogeneous training, against the CPU.

    python -m loadtest.bench_gpu [--sections dense,lean,train] [--store DIR] [--rehearse-cpu] [--quick]
                                 [--results-dir DIR]

Three sections, each with its CPU baseline measured in the same run:

- ``dense``: the dense model alone (a Criteo DLRM version trained into a temporary store unless
  ``--store`` gives one), p50/p99 of one call at batch 200 and 2,048 for CPU TorchScript
  (``--cpu-threads`` intra-op threads), CUDA TorchScript (``torchscript-cuda``) and CUDA graphs
  (``cuda-graphs``), inputs from the host as a scoring process hands them over;
- ``lean``: ``recserve serve`` with co-located lookups, ``--device cpu`` and then ``--device cuda``
  (its runtime chosen by timing at load: ``--runtime auto``), under locust at 200, 1,000 and 2,000
  requests/s of 200 items each (``bench_e2e``'s load); per device the highest rate held at
  p99 <= 10 ms with no failure;
- ``train``: 1M ``recserve synth`` rows, one epoch, batch 128: ``recserve train`` hybrid (PS shards
  on the CPU, K=4) with the dense network on the CPU and on the GPU, in-process tables on the GPU
  (``--embeddings inprocess``), and the plain-PyTorch peer on the GPU (``loadtest/peer_dlrm.py
  --device cuda``): samples/s and test AUC of each, each a process of its own.

Writes ``loadtest/results/gpu.json`` naming the card, prints tables and the issue's targets. Sized
to finish in under 8 minutes on a 16-core H100 host.

Without CUDA it prints why and exits 0, writing nothing. ``--rehearse-cpu`` runs the same script
on a host without a GPU: every ``cuda`` replaced by ``cpu`` (each such figure marked
``"ran_on": "cpu"``), written to ``gpu-rehearsal.json``; its figures say nothing about a GPU, it
checks the script. ``--quick``: tiny sizes (seconds per part).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from loadtest.common import (
    Stopwatch,
    call_times,
    given_or_trained,
    parse,
    parser,
    percentiles_ms,
    print_table,
    report_targets,
    write_results,
)

SECTIONS = ("dense", "lean", "train")
DENSE_RUNTIMES = ("torchscript", "torchscript-cuda", "cuda-graphs")
"""What the dense section times: the CPU baseline, then the CUDA runtimes."""
TRAIN_VARIANTS: dict[str, list[str]] = {
    "hybrid_cpu": ["--sharding", "ps", "--staleness", "4", "--device", "cpu"],
    "hybrid_gpu": ["--sharding", "ps", "--staleness", "4", "--device", "cuda"],
    "inprocess_gpu": ["--embeddings", "inprocess", "--device", "cuda"],
}
"""The ``recserve train`` runs (``peer_gpu``, the peer's, runs beside them)."""
NO_CUDA = (
    "bench-gpu: skipped: torch sees no CUDA device (a CPU-only torch, no driver, or "
    "CUDA_VISIBLE_DEVICES hides them); nothing written. `python -m loadtest.bench_gpu --rehearse-cpu` "
    "rehearses it on the CPU."
)


class Place:
    """Where the parts that want a GPU run: ``cuda``, or ``cpu`` in a rehearsal."""

    def __init__(self, rehearse: bool):
        self.rehearse = rehearse

    def device(self, wanted: str) -> str:
        return "cpu" if self.rehearse else wanted

    def runtime(self, wanted: str) -> str:
        """A CUDA runtime's CPU stand-in in a rehearsal (the TorchScript export it runs)."""
        from model_store import runtimes

        return runtimes.get(wanted).source if self.rehearse else wanted

    def argv(self, args: list[str]) -> list[str]:
        return [self.device(a) if a == "cuda" else a for a in args]

    def card(self) -> dict[str, Any]:
        import torch

        if self.rehearse:
            return {"name": "none (rehearsal on the CPU)", "torch": torch.__version__}
        props = torch.cuda.get_device_properties(0)
        return {"name": torch.cuda.get_device_name(0), "memory_gb": round(props.total_memory / 2**30, 1),
                "cuda": torch.version.cuda, "torch": torch.__version__}  # fmt: skip


# ---- dense ---------------------------------------------------------------------------------------
def dense_section(vdir: Path, place: Place, args: argparse.Namespace) -> dict:
    """p50/p99 (ms) of one dense call per runtime and batch size, the inputs on the host."""
    import torch

    from model_store import read_manifest, runtimes
    from model_store.devices import timing_batch

    manifest = read_manifest(vdir)
    rows = []
    every_core = os.cpu_count() or 1
    runs = [(n, args.cpu_threads) for n in DENSE_RUNTIMES]
    if every_core > args.cpu_threads:  # the CPU at its best too, so the GPU's ratio is not flattered
        runs.insert(1, (DENSE_RUNTIMES[0], every_core))
    for name, threads in runs:
        ran = place.runtime(name)
        torch.set_num_threads(threads)
        fn = runtimes.get(ran).load(vdir / manifest.dense[runtimes.get(ran).source], threads)
        for batch in args.batches:
            pooled, dense = timing_batch(manifest, batch)
            times = call_times(partial(fn, pooled, dense), args.dense_runs, args.dense_seconds, warmup=20)
            rows.append({"runtime": name, "threads": threads, "batch": batch, "ran_on": runtimes.get(ran).device,
                         **percentiles_ms(times)})  # fmt: skip
    torch.set_num_threads(args.cpu_threads)
    print_table("dense model alone (ms per call)", rows,
                ["runtime", "threads", "batch", "ran_on", "p50_ms", "p99_ms"])  # fmt: skip
    return {"rows": rows, "cpu_threads": args.cpu_threads, "model": manifest.model_config.get("kind", "")}


# ---- lean frontend -------------------------------------------------------------------------------
def lean_section(store: Path, place: Place, args: argparse.Namespace, work: Path) -> dict:
    """``recserve serve`` co-located, dense on the CPU then on the GPU, at each rate."""
    from loadtest.drive import lean_frontend, request_bodies, run_locust, warm_up
    from serving.stack.metrics import lookup_modes

    bodies = request_bodies()
    out: dict[str, Any] = {"rates": args.rates, "duration_s": args.duration}
    for device in ("cpu", "cuda"):
        extra = ("--device", place.device(device), "--threads", str(args.cpu_threads))
        if place.device(device) != device:  # a rehearsal: the same server as the CPU's, not run twice
            out[device] = {**out["cpu"], "same_run_as": "cpu"}
            continue
        with lean_frontend(store, "criteo", "colocated", None, work, "auto", 1.0, extra) as (endpoint, procs):
            host = endpoint.split("/predictions/")[0]
            warm_up(endpoint, None, bodies, args.warmup_s)
            shown = lookup_modes(host.removeprefix("http://"))
            by_rate = {}
            for rate in args.rates:
                r = run_locust(host, "criteo", rate, args.duration, None, work, procs)
                by_rate[f"{rate:g}"] = {k: r[k] for k in ("p50_ms", "p99_ms", "requests", "failures",
                                                          "achieved_rps", "server_timing_p50_ms")}  # fmt: skip
                print(f"  lean dense on {device} ({place.device(device)}), {rate:g} rps: p50 {r['p50_ms']} ms, "
                      f"p99 {r['p99_ms']} ms, {r['failures']} failures", flush=True)  # fmt: skip
        held = [float(k) for k, r in by_rate.items() if r["p99_ms"] is not None and r["p99_ms"] <= 10.0
                and not r["failures"]]  # fmt: skip
        out[device] = {"ran_on": place.device(device), "runtime": shown.get("runtimes"),
                       "devices": shown.get("devices"), "rates": by_rate,
                       "max_rps_p99_le_10ms": max(held) if held else 0.0}  # fmt: skip
    rows = [{"device": d, "rps": k, **{c: r[c] for c in ("p50_ms", "p99_ms", "failures", "achieved_rps")}}
            for d in ("cpu", "cuda") for k, r in out[d]["rates"].items()]  # fmt: skip
    print_table("lean frontend, co-located lookups, 200 items a request", rows,
                ["device", "rps", "p50_ms", "p99_ms", "failures", "achieved_rps"])  # fmt: skip
    return out


# ---- training ------------------------------------------------------------------------------------
def train_section(place: Place, args: argparse.Namespace) -> dict:
    """Samples/s and AUC of each variant on the same synth rows, each a process of its own."""
    from loadtest.bench_train import _child, synth_data

    train_file, test_file = synth_data(args.synth_rows, Path(args.synth_dir))
    base = [sys.executable, "-m", "recserve", "train", "--data", str(train_file), "--test", str(test_file),
            "--epochs", "1", "--batch-size", "128", "--no-export", "--no-progress", "--log-level", "WARNING"]  # fmt: skip
    peer = [sys.executable, "-m", "loadtest.peer_dlrm", "--train", str(train_file), "--test", str(test_file),
            "--device", "cuda", "--threads", str(max(1, (os.cpu_count() or 2) // 2))]  # fmt: skip
    runs: dict[str, Any] = {}
    ran: dict[tuple[str, ...], str] = {}  # command -> the variant that ran it (a rehearsal repeats some)
    for name, cmd in [("peer_gpu", peer), *((n, base + f) for n, f in TRAIN_VARIANTS.items())]:
        argv = tuple(place.argv(cmd))
        if argv in ran:
            runs[name] = {**runs[ran[argv]], "same_run_as": ran[argv]}
            continue
        r, ran[argv] = _child(list(argv)), name
        runs[name] = {k: r[k] for k in ("auc", "logloss", "samples_per_s", "wall_s", "peak_rss_gb")}
        runs[name]["ran_on"] = "cpu" if name.endswith("_cpu") else place.device("cuda")
        print(f"  train {name:14s} auc {r['auc']:.4f} {r['samples_per_s']:9.0f} samples/s", flush=True)
    print_table("training, one epoch", [{"variant": n, **r} for n, r in runs.items()],
                ["variant", "ran_on", "auc", "samples_per_s", "wall_s", "peak_rss_gb"])  # fmt: skip
    return {"rows": args.synth_rows, "epochs": 1, "batch_size": 128, "runs": runs}


def kept(result: dict, section: str, measure: Callable[[], dict]) -> None:
    """``result[section] = measure()``; a section that fails is recorded as ``{"error": ...}`` and
    the others still run and are written (a lent GPU's minutes are too few to lose a whole run)."""
    try:
        result[section] = measure()
    except Exception as e:  # recorded in the JSON and printed, and the exit is non-zero
        print(f"bench-gpu: section {section} failed: {e}", file=sys.stderr, flush=True)
        result[section] = {"error": str(e)[:4000]}


# ---- targets -------------------------------------------------------------------------------------
def targets(result: dict) -> dict[str, bool]:
    """The issue's "done when" figures, for the sections measured."""
    checks: dict[str, bool] = {}
    result = {k: v for k, v in result.items() if not (isinstance(v, dict) and "error" in v)}
    if "dense" in result:
        at = [r for r in result["dense"]["rows"] if r["batch"] == 2048]
        cpu = [r["p50_ms"] for r in at if r["runtime"] == DENSE_RUNTIMES[0]]
        gpu = [r["p50_ms"] for r in at if r["runtime"] != DENSE_RUNTIMES[0]]
        if cpu and gpu:  # the CPU's best (every core), against the faster CUDA runtime
            checks["dense at 2,048 on the GPU <= 0.2x the CPU's time"] = min(gpu) <= 0.2 * min(cpu)
    if "lean" in result:
        cpu, gpu = (result["lean"][d]["max_rps_p99_le_10ms"] for d in ("cpu", "cuda"))
        checks["lean, dense on the GPU, holds >= 2x the CPU's highest rate at p99 <= 10 ms"] = (
            gpu >= 2 * cpu > 0
        )
    if "train" in result:
        r = result["train"]["runs"]
        sps = {n: v["samples_per_s"] for n, v in r.items()}
        checks["hybrid-on-GPU >= 0.7x the GPU peer's samples/s"] = sps["hybrid_gpu"] >= 0.7 * sps["peer_gpu"]
        checks["hybrid-on-GPU AUC within 0.005 of the GPU peer's"] = (
            abs(r["hybrid_gpu"]["auc"] - r["peer_gpu"]["auc"]) <= 0.005
        )
        checks["hybrid-on-GPU >= 3x CPU hybrid's samples/s"] = sps["hybrid_gpu"] >= 3 * sps["hybrid_cpu"]
    return checks


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated: {', '.join(SECTIONS)}")
    p.add_argument("--rehearse-cpu", action="store_true", help="run it all on the CPU (no GPU needed)")
    p.add_argument(
        "--store", default=None, help="model store with a published criteo version (default: train one)"
    )
    p.add_argument("--cpu-threads", type=int, default=1, help="intra-op threads of the CPU dense runtime")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[200, 2048])
    p.add_argument(
        "--dense-runs", type=int, default=300, help="dense: least timed calls per runtime and batch"
    )
    p.add_argument(
        "--dense-seconds", type=float, default=1.0, help="dense: least seconds per runtime and batch"
    )
    p.add_argument(
        "--rates", type=lambda s: [float(x) for x in s.split(",")], default=[200.0, 1000.0, 2000.0]
    )
    p.add_argument("--duration", type=float, default=15.0, help="lean: seconds at each rate")
    p.add_argument("--warmup-s", type=float, default=3.0, help="lean: warm-up seconds per server")
    p.add_argument("--synth-rows", type=int, default=1_000_000, help="train: synth training rows")
    p.add_argument("--synth-dir", default=str(Path(tempfile.gettempdir()) / "recserve-bench-synth"))
    args = parse(p, argv, {"batches": [200, 2048], "dense_runs": 20, "dense_seconds": 0.05, "rates": [5.0, 10.0, 20.0],
                           "duration": 1.0, "warmup_s": 0.5, "synth_rows": 2000})  # fmt: skip
    sections = [s for s in args.sections.split(",") if s]
    if set(sections) - set(SECTIONS):
        p.error(f"unknown sections {sorted(set(sections) - set(SECTIONS))}; known: {', '.join(SECTIONS)}")
    import torch

    if not args.rehearse_cpu and not torch.cuda.is_available():
        print(NO_CUDA, flush=True)
        return 0
    place = Place(args.rehearse_cpu)
    result: dict[str, Any] = {"card": place.card(), "rehearsal": place.rehearse, "sections": sections}
    print(f"bench-gpu on {result['card']['name']}", flush=True)
    sw = Stopwatch()
    with contextlib.ExitStack() as es:
        work = Path(es.enter_context(tempfile.TemporaryDirectory(prefix="bench-gpu-")))
        store = given_or_trained(args.store, work) if {"dense", "lean"} & set(sections) else None
        if store is not None and "dense" in sections:
            from model_store import current, version_dir

            served = current(store, "criteo")
            if served is None:
                raise SystemExit(f"bench-gpu: {store} has no published criteo version")
            kept(result, "dense", partial(dense_section, version_dir(store, "criteo", served), place, args))
        if store is not None and "lean" in sections:
            kept(result, "lean", partial(lean_section, store, place, args, work))
        if "train" in sections:
            kept(result, "train", partial(train_section, place, args))
    result["wall_s"] = round(sw.s, 1)
    print(f"\ntargets{' (rehearsal on the CPU: not a measurement of a GPU)' if place.rehearse else ''}:")
    report_targets(result, targets(result))
    result["machine"] = {
        "loadavg_after": round(os.getloadavg()[0], 2),
        "when": time.strftime("%Y-%m-%d %H:%M"),
    }
    path = write_results("gpu-rehearsal" if place.rehearse else "gpu", result, args.results_dir)
    print(f"wrote {path} ({result['wall_s']:.0f} s)")
    failed = [s for s in sections if "error" in result.get(s, {})]
    if failed:
        print(
            f"bench-gpu: sections that failed: {', '.join(failed)} (their errors are in {path})",
            file=sys.stderr,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
