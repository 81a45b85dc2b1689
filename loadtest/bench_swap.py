"""``make bench-swap``: hot swaps under load.

    python -m loadtest.bench_swap [--duration 90] [--rate 50] [--deltas 10] [--delta-rows 10000]
                                  [--frontend serve|torchserve] [--workers auto|N]
                                  [--lookups remote,colocated] [--rounds 2]
                                  [--serving-dtype float32[,int8]] [--quick] [--results-dir DIR]

Trains two versions into a temporary model store from the same schema file but on *different
data* (v1 on the first half of the training split, v2 on the second, so their fitted dense
statistics differ, as in a daily retrain; v1 published, v2 held back), starts the frontend, and
runs locust (200-item JSON requests) at a fixed rate for ``--duration`` s. Meanwhile: after a
steady period, ``--deltas`` deltas of ``--delta-rows`` changed rows each are published into the
served version (one every few seconds, by ``training.follow.cut.DeltaWriter``, in the version's
serving dtype), then v2 is published.

What answers (``--frontend``, ``loadtest.swap_frontends``): by default ``recserve serve --workers
auto``, the frontend as deployed (token auth on; ``--workers N``: another count), each worker
process following the store on its own: it applies the deltas to its co-located shards, and loads
v2 beside v1 (remote: once every PS shard serves v2), switches, and closes v1 ``drain_s`` later.
Or ``torchserve``: ``recserve up``'s TorchServe with the scoring handler (the PS shards map v2
beside v1; the controller waits until every shard serves v2, then registers v2's dense model in
TorchServe, makes it the default, lets v1 drain and unregisters it: the last event's window ends
when TorchServe no longer lists v1).

The whole schedule runs once per lookup mode of the frontend (``--lookups``), ``--rounds`` times,
interleaved (remote, colocated, remote, ...), each on a fresh copy of the two trained versions:
``remote`` (rows through the embedding worker and the PS shards) and ``colocated`` (the scoring
process maps the version's shard files and applies its deltas itself; behind TorchServe the PS
shards still run, behind ``recserve serve`` none does). With several ``--serving-dtype`` values
(``float32,int8``) all of it runs once per dtype, each dtype's versions and deltas written in it.

Every response's ``versions`` and process are recorded: a response is *mixed* when the embedding version it
read (any shard) differs from its dense model's version. Each event's window runs from its publish
until it is live everywhere a request reads it (``loadtest/swap_analysis.py``): steady p50/p99
against during-swap p50/p99 (the first delta included), one row per event (its window, requests,
p50/p99/max, and the handler's stage times from ``Server-Timing``: a stall shows where it was).

Writes loadtest/results/swap.json (``runs``, one per dtype x mode x round: ``failures``,
``mixed_responses``, ``p50/p99_steady_ms``, ``p50/p99_during_swap_ms``, ``p99_ratio`` (during
swap / steady), ``p99_during_deltas_ms`` and ``p99_deltas_ratio`` (the deltas' windows only),
``placebo_deltas_ratio`` {p50, p90} (that ratio for the same windows placed where no delta is:
the noise it is compared with), ``first_delta_p99_ms``, ``full_switch_window_s``,
``delta_visible_p50/p99_s`` (publish -> the first response that read it), ``delta_ps_live_p99_s``
(every PS shard; 0 with none), ``stages``, ``per_event``, ``per_process`` (per worker process that
answered: its requests, failures, mixed responses, p99 steady and during swaps, delta_visible_p99_s);
``summary``: per dtype and mode, every round's p99s
and the worst ratio) and
swap-<lookups>-<dtype>-<round>.png (latency over time with every event marked). ``--quick``: 2
deltas and the switch in 16 s of load, co-located lookups only, one round, one epoch of training.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from loadtest.common import (
    CRITEO_TRAIN,
    parse,
    parser,
    print_table,
    read_timeline,
    report_targets,
    start_locust_timeline,
    train_version,
    write_results,
)
from loadtest.swap_analysis import analyse, plot
from loadtest.swap_frontends import FRONTENDS, started


def train_versions(root: Path, epochs: int = 2, serving_dtype: str = "float32") -> list[str]:
    """v1 on the first half of the training rows (published), v2 on the second half (held back):
    the same schema file, different fitted dense statistics, tables served in ``serving_dtype``
    (their deltas too). Returns the manifests' fingerprints."""
    import model_store as ms

    lines = CRITEO_TRAIN.read_bytes().splitlines(keepends=True)
    halves = [lines[: len(lines) // 2], lines[len(lines) // 2 :]]
    fingerprints = []
    for seed, (publish, rows) in enumerate(zip((True, False), halves, strict=True)):
        data = root.parent / f"train-{seed}.tsv"
        data.write_bytes(b"".join(rows))
        result = train_version(root, seed, publish, data, epochs, serving_dtype)
        if result.version_dir is None:
            raise RuntimeError(f"training on {data} exported no version")
        fingerprints.append(ms.read_manifest(Path(result.version_dir), verify=False).schema_fingerprint)
    return fingerprints


def swap_schedule(root: Path, front, args, events: list[dict]) -> None:
    """The swaps, run in a thread while locust runs. Appends {kind, start, live} per event."""
    import model_store as ms
    from model_store.releases import publish
    from training.follow.cut import DeltaWriter

    rng = np.random.default_rng(0)
    time.sleep(args.steady_s)
    writer = DeltaWriter(root, "criteo")
    all_signs = writer.signs()
    for _ in range(args.deltas):
        signs = rng.choice(all_signs, size=min(args.delta_rows, len(all_signs)), replace=False)
        writer.assign(
            signs, writer.lookup(signs) + rng.normal(0, 0.01, (len(signs), writer.dim)).astype(np.float32)
        )
        seq, _, published = writer.publish()
        live = front.delta(seq, published)
        events.append({"kind": "delta", "seq": seq, "start": published, "live": live})
        time.sleep(max(0.0, args.delta_every_s - (time.time() - published)))
    time.sleep(args.delta_every_s)
    old, v2 = ms.versions(root, "criteo")
    t0 = time.time()
    publish(root, "criteo", v2)
    events.extend(front.switch(root, v2, old, t0))
    time.sleep(args.after_s)  # responses after the switch count too


def run(args) -> list[dict]:
    """Every run: per serving dtype, two versions trained once, then ``--rounds`` rounds of the
    lookup modes, interleaved (remote, colocated, remote, colocated, ...), each on a fresh copy."""
    work = Path(tempfile.mkdtemp(prefix="bench-swap-"))
    runs = []
    try:
        for dtype in args.serving_dtype.split(","):
            trained = work / dtype / "trained"
            trained.parent.mkdir(parents=True)
            print(f"training two {dtype} versions on different halves of the data ...", flush=True)
            fingerprints = train_versions(trained, args.epochs, dtype)
            if len(set(fingerprints)) != 1:
                raise RuntimeError(f"the two versions' schema fingerprints differ: {fingerprints}")
            for round_ in range(args.rounds):
                for lookups in args.lookups.split(","):
                    root = work / dtype / f"{lookups}-{round_}" / "store"
                    shutil.copytree(trained, root)  # the deltas and the publish change it: a fresh copy
                    runs.append(run_mode(root, lookups, dtype, round_, args))
                    shutil.rmtree(root.parent, ignore_errors=True)
        return runs
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_mode(root: Path, lookups: str, dtype: str, round_: int, args) -> dict:
    work = root.parent
    print(f"round {round_}, {dtype}: starting {args.frontend}, lookups {lookups} ...", flush=True)
    with started(args.frontend, root, lookups, work, args) as front:
        timeline = work / "timeline.txt"
        events: list[dict] = []
        t_start = time.time()
        locust = start_locust_timeline(
            front.host, args.rate, args.duration, timeline, key_file=front.key_file
        )
        errors: list[BaseException] = []

        def swaps():
            try:
                swap_schedule(root, front, args, events)
            except BaseException as e:  # reported after the run
                errors.append(e)

        th = threading.Thread(target=swaps)
        th.start()
        th.join()
        _, stderr = locust.communicate(timeout=args.duration + 120)
        if errors:
            raise errors[0]
        if not timeline.exists():
            raise RuntimeError(f"locust wrote no timeline:\n{stderr[-3000:]}")
    tl = read_timeline(timeline)
    try:
        figures = analyse(tl, events, t_start)
    except RuntimeError as e:
        raise RuntimeError(f"{e} ({lookups} lookups, {dtype})") from None
    png = args.results_dir / f"swap-{lookups}-{dtype}-{round_}.png"
    plot(tl, t_start, figures["events"], png,
         f"recserve {args.frontend} ({lookups} lookups, {dtype} tables, round {round_}): latency at {args.rate} req/s "
         "while deltas, a full version and a dense model are swapped in")  # fmt: skip
    conditions = {"frontend": args.frontend, "workers": front.workers, "rate": args.rate,
                  "duration_s": args.duration, "deltas": args.deltas,
                  "delta_rows": args.delta_rows, "poll_s": args.poll_s, "serving_dtype": dtype,
                  "loadavg": os.getloadavg()}  # fmt: skip
    return {"lookups": lookups, "serving_dtype": dtype, "round": round_, **figures, "conditions": conditions}


def summary(runs: list[dict]) -> dict:
    """Per serving dtype and lookup mode, every round's steady and during-swap p99 and the worst
    ratio: {dtype: {lookups: {...}}}."""
    out: dict = {}
    for r in runs:
        mode = out.setdefault(r["serving_dtype"], {}).setdefault(r["lookups"], {
            "rounds": 0, "p99_steady_ms": [], "p99_during_swap_ms": [], "first_delta_p99_ms": [],
            "p99_ratio": [], "failures": 0, "mixed_responses": 0})  # fmt: skip
        mode["rounds"] += 1
        for k in ("p99_steady_ms", "p99_during_swap_ms", "first_delta_p99_ms", "p99_ratio"):
            mode[k].append(r[k])
        mode["failures"] += r["failures"]
        mode["mixed_responses"] += r["mixed_responses"]
    for modes in out.values():
        for mode in modes.values():
            mode["worst_p99_ratio"] = max((x for x in mode["p99_ratio"] if x is not None), default=None)
    return out


def main(argv: list[str] | None = None) -> int:
    from serving.scoring.lean import workers_flag

    p = parser(__doc__)
    p.add_argument("--duration", type=int, default=90)
    p.add_argument("--rate", type=int, default=50)
    p.add_argument("--deltas", type=int, default=10)
    p.add_argument("--delta-rows", type=int, default=10_000)
    p.add_argument("--delta-every-s", type=float, default=4.0)
    p.add_argument("--steady-s", type=float, default=15.0)
    p.add_argument("--poll-s", type=float, default=0.2)
    p.add_argument("--epochs", type=int, default=2, help="each version's training epochs")
    p.add_argument("--after-s", type=float, default=5.0, help="load kept on after the dense switch")
    p.add_argument(
        "--frontend",
        default="serve",
        choices=FRONTENDS,
        help="what answers: recserve serve (as deployed) or recserve up's TorchServe handler",
    )
    p.add_argument(
        "--workers",
        default="auto",
        type=workers_flag,
        metavar="N|auto",
        help="recserve serve's worker processes (auto, its default: one per CPU)",
    )
    p.add_argument("--lookups", default="remote,colocated", help="the frontend's lookup modes, one run each")
    p.add_argument("--rounds", type=int, default=2, help="runs of every lookup mode, interleaved")
    p.add_argument(
        "--serving-dtype", default="float32", type=_dtypes,
        help="the versions' serving dtype (full versions and deltas): float32, float16 or int8; several "
        "joined by commas (float32,int8) run the whole schedule once per dtype",
    )  # fmt: skip
    quick = {"duration": 16, "deltas": 2, "delta_rows": 1000, "delta_every_s": 1.0, "steady_s": 4.0,
             "after_s": 1.0, "lookups": "colocated", "epochs": 1, "rounds": 1}  # fmt: skip
    args = parse(p, argv, quick)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    runs = run(args)
    key = ["serving_dtype", "lookups", "round"]
    cols = [*key, "requests", "failures", "mixed_responses", "p50_steady_ms", "p99_steady_ms", "p50_during_swap_ms",
            "p99_during_swap_ms", "p99_ratio", "p99_during_deltas_ms", "p99_deltas_ratio", "placebo_deltas_ratio_p90",
            "first_delta_p99_ms", "full_switch_window_s", "full_switch_p99_ms", "delta_visible_p50_s", "delta_visible_p99_s",
            "delta_ps_live_p99_s"]  # fmt: skip
    placebo = [{**r, "placebo_deltas_ratio_p90": (r["placebo_deltas_ratio"] or {}).get("p90")} for r in runs]
    print_table("hot swap under load (ms; during swap = overlapping any event's window; placebo: the deltas' "
                "windows where no delta is)", placebo, cols)  # fmt: skip
    print_table("per event (publish -> live everywhere a request reads it); handler stages from Server-Timing",
                [{**{k: r[k] for k in key}, **row} for r in runs for row in r["per_event"]],
                [*key, "event", "window_s", "requests", "p50_ms", "p99_ms", "max_ms", "server_max_ms",
                 "worker_max_ms", "dense_max_ms"])  # fmt: skip
    print_table("per worker process (X-Recserve-Pid; -1: not named, as TorchServe's)",
                [{**{k: r[k] for k in key}, "pid": pid, **row} for r in runs for pid, row in r["per_process"].items()],
                [*key, "pid", "requests", "failures", "mixed_responses", "p99_steady_ms", "p99_during_swap_ms",
                 "p99_ratio", "delta_visible_p99_s"])  # fmt: skip
    checks: dict[str, bool] = {}
    for r in runs:
        m = f"{r['serving_dtype']} {r['lookups']} round {r['round']}"
        checks |= {
            f"{m}: 0 failures": r["failures"] == 0,
            f"{m}: 0 mixed responses": r["mixed_responses"] == 0,
            f"{m}: p99_during_swap <= 1.5x p99_steady (first delta included)": (r["p99_ratio"] or 2.0) <= 1.5,
            f"{m}: p99_during_deltas <= 1.5x p99_steady": (r["p99_deltas_ratio"] or 2.0) <= 1.5,
            f"{m}: delta_visible_p99 <= 1 s": r["delta_visible_p99_s"] <= 1,
        }
    result = {"runs": runs, "summary": summary(runs)}
    report_targets(result, checks)
    path = write_results("swap", result, args.results_dir)
    print(f"\nwrote {path} and swap-<lookups>-<dtype>-<round>.png beside it")
    return 0


def _dtypes(value: str) -> str:
    """``--serving-dtype``: one dtype or several joined by commas, each one served."""
    from model_store.quant import SERVING_DTYPES

    bad = [d for d in value.split(",") if d not in SERVING_DTYPES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown serving dtype(s) {bad}; choose from {', '.join(SERVING_DTYPES)}"
        )
    return value


if __name__ == "__main__":
    raise SystemExit(main())
