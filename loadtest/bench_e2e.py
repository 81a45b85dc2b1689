"""``make bench-e2e``: every scoring frontend x lookup mode under locust at fixed rates, against one
process; then ``recserve serve --workers 1`` and ``--workers 2`` as deployed, and an open loop.

    python -m loadtest.bench_e2e [--store DIR --model NAME] [--duration 30] [--rates 10,50,100,200]
                                 [--runs lean:colocated,lean:remote,torchserve:colocated,torchserve:remote]
                                 [--forms records,columns] [--ts-workers 2] [--workers 1,2]
                                 [--workers-rates 50,100,200,...] [--workers-step 25] [--open-rates 10,50]
                                 [--out e2e]
                                 [--median-runs 100] [--median-s 1]
                                 [--quick] [--results-dir DIR]

Trains a model into a temporary model store unless one is given, then for each run starts what it
needs on this machine -- ``lean``: ``recserve serve`` (uvicorn/uvloop); ``torchserve``: the local
stack (PS shards, embedding worker, TorchServe with the recserve handler); ``colocated``: the
scoring process maps the version's shard files itself; ``remote``: lookups go through the worker
process and the PS shards -- warms it up, and runs locust headless (``loadtest/locustfile.py``:
FastHttpUser, 200-item JSON requests cut from the 2,000 Criteo test rows) at each fixed rate for
``--duration`` seconds, in each request form of ``--forms`` in turn at each rate on the same server
(``records``: a list of flat records, what most clients send; ``columns``: a ranking request in
column form). Every request's latency is recorded exactly (not locust's rounded buckets).

Reference, per form: ``inprocess_p50_ms``, the same requests scored in ONE process (features,
embedding tables in memory, dense model: the Scorer over an in-process EmbeddingWorker on
InProcessShards), and ``decode_p50_ms``, the scoring core's decode of them.
Per run and rate: p50/p99, failures, the scoring core's ``Server-Timing`` stages (decode, worker,
dense, encode, total) and the rest of each request's latency (client + HTTP + frontend), and the
CPU time per request of each process (locust included), which a shared machine disturbs less than
wall time; per run ``max_rps_p99_le_10ms``. The torchserve + remote run also times each stage
sequentially (``stages_ms``). Token auth is off in these runs (loopback only).

``workers`` and ``open_loop`` (``loadtest.e2e_workers``): each count of ``--workers`` in turn,
co-located, token auth on, stepped up through ``--workers-rates`` to its max rate at p99 <= 10 ms in
both forms (then bisected to ``--workers-step`` requests/s between the last rate held and the first
missed), with CPU per request and PSS per process; the open loop runs ``--workers 1`` at each of
``--open-rates`` on a fixed schedule, latency counted from when each request was due. Writes
loadtest/results/<out>.json and prints tables; stops everything at the end, also on error.
``--quick``: lean + co-located and TorchServe + remote at 10 requests/s for 1 s; workers at 50; each
sequential median over 10 calls.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from loadtest.common import (
    given_or_trained,
    parse,
    parser,
    print_table,
    report_targets,
    write_results,
)
from loadtest.drive import (
    lean_frontend,
    request_bodies,
    run_locust,
    stack_processes,
    warm_up,
)
from loadtest.e2e_stages import Sampling, median_ms, stages
from loadtest.e2e_workers import TARGETS as WORKER_TARGETS
from loadtest.e2e_workers import numbers, print_workers, worker_checks, workers_section
from model_store.dense import AUTO, CHOICES

if TYPE_CHECKING:
    pass

TARGETS = {
    "lean_p99_ms_at_50": 6.0,
    "p99_ms_at_50": 10.0,
    "failures": 0,
    "lean_p50_at_10_over_inprocess": 1.5,
    "lean_max_rps_p99_le_10ms": 200,
    **WORKER_TARGETS,
}


# ---- one frontend x lookup mode ----------------------------------------------------------------
RUNS = ("lean:colocated", "lean:remote", "torchserve:colocated", "torchserve:remote")


def run_one(
    args,
    frontend: str,
    lookups: str,
    store: Path,
    rates: list[float],
    bodies: dict[str, list[bytes]],
    work: Path,
    batch_wait_ms: float,
) -> list[dict]:
    """Start what ``frontend`` x ``lookups`` needs, warm it up, load it at every rate in each request
    form (``bodies``: form -> requests), stop it. One result per form."""
    from serving.stack.local import LocalStack, StackConfig

    stack = None
    with contextlib.ExitStack() as es:
        if frontend == "torchserve" or lookups == "remote":  # TorchServe and/or the PS + worker processes
            cfg = StackConfig(store=str(store), model=args.model, run_dir=str(work / f"run-{frontend}-{lookups}"),
                              http_port=0, management_port=0, metrics_port=0, runtime=args.runtime,
                              disable_token_auth=True, ts_workers=args.ts_workers, batch_size=args.batch_size,
                              max_batch_delay_ms=args.max_batch_delay_ms, ps_shards=args.ps_shards,
                              lookups=lookups if frontend == "torchserve" else "remote")  # fmt: skip
            stack = LocalStack(cfg).start()
            es.callback(stack.stop)
        if frontend == "lean":
            endpoint, procs = es.enter_context(
                lean_frontend(
                    store,
                    args.model,
                    lookups,
                    stack.state if stack else None,
                    work,
                    args.runtime,
                    batch_wait_ms,
                )  # fmt: skip
            )
        else:
            assert stack is not None  # not lean: TorchServe, started above
            endpoint, procs = stack.state.endpoint, stack_processes(stack.state)
        n = warm_up(endpoint, None, [b for form in bodies.values() for b in form], args.warmup_s)
        label = f"{frontend} + {lookups}" + (
            f" (batch wait {batch_wait_ms:g} ms)" if frontend == "lean" else ""
        )
        print(f"{label}: {endpoint}; warm-up {n} requests in {args.warmup_s:g} s", flush=True)
        host = endpoint.split("/predictions/")[0]
        results: dict[str, dict] = {form: {} for form in bodies}
        for rate in rates:  # the forms interleaved: a busy minute of the machine falls on both
            for form in bodies:
                r = run_locust(
                    host, args.model, rate, args.duration, None, work, procs, columns=form == "columns"
                )
                results[form][f"{rate:g}"] = r
                print(f"  {form}, {rate:g} rps: p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms, "
                      f"{r['requests']} requests, {r['failures']} failures", flush=True)  # fmt: skip
        stage_ms = None
        if stack is not None and frontend == "torchserve" and lookups == "remote":
            vdir = Path(stack.state.config.store) / args.model / stack.state.version
            stage_ms, _ = stages(vdir, stack.state, next(iter(bodies.values())), args.runtime, False,
                                 sampling(args))  # fmt: skip
    out = []
    for form, by_rate in results.items():
        ok = [
            float(k)
            for k, r in by_rate.items()
            if r["p99_ms"] is not None and r["p99_ms"] <= 10.0 and not r["failures"]
        ]
        out.append({"frontend": frontend, "lookups": lookups, "form": form, "rates": by_rate,
                    "batch_wait_ms": batch_wait_ms if frontend == "lean" else None,
                    "max_rps_p99_le_10ms": max(ok) if ok else 0.0, "stages_ms": stage_ms})  # fmt: skip
        stage_ms = None  # timed once, with the first form's requests
    return out


def sampling(args) -> Sampling:
    """How long each sequential median (the in-process reference, the stages) runs."""
    return Sampling(args.median_runs, args.median_s)


def inprocess_p50_ms(vdir: Path, bodies: list[bytes], timing: Sampling) -> tuple[float, float]:
    """The same requests scored in ONE process (features, embedding tables in memory, dense), and
    their decode alone: p50s in ms."""
    import model_store
    from features.schema import load_schema
    from serving.scoring.config import ScoringConfig
    from serving.scoring.core import JSON, Scorer
    from serving.scoring.loop import score
    from serving.worker.core import EmbeddingWorker, InProcessShard
    from training.offline import load_stores

    schema = load_schema(vdir / "schema.yaml")
    inproc_worker = EmbeddingWorker(
        [InProcessShard(s) for s in load_stores(vdir, model_store.read_manifest(vdir))], schema
    )
    scorer = Scorer(ScoringConfig(str(vdir), lookups="remote"), worker=inproc_worker)
    try:
        return median_ms(lambda b: score(scorer, b, JSON), bodies, timing), median_ms(
            lambda b: scorer.decode(b, JSON), bodies, timing
        )
    finally:
        scorer.close()


def _rate_rows(runs: list[dict], part: str | None = None) -> list[dict]:
    """A table row per run and rate: its figures (``part``: one dict of them)."""
    return [
        {"run": _name(x), "rate": k, **(v[part] if part else v)} for x in runs for k, v in x["rates"].items()
    ]


def _name(run: dict) -> str:
    wait = run.get("batch_wait_ms")
    return (
        f"{run['frontend']}+{run['lookups']}"
        + (f"+wait{wait:g}" if wait is not None else "")
        + f" {run['form']}"
    )


# ---- main ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--store", help="existing model store (default: train one into a temp dir)")
    p.add_argument("--model", default="criteo")
    p.add_argument("--rates", default="10,50,100,200", help="requests/s, comma-separated")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per rate")
    p.add_argument("--warmup-s", type=float, default=30.0,
                   help="sequential warm-up before measuring (TorchServe's JVM compiles its request path "
                        "over ~7,000 requests: its p50 at 50 rps was 0.3-0.5 ms lower after 30 s than 5)")  # fmt: skip
    p.add_argument("--runtime", default=AUTO, choices=CHOICES)
    p.add_argument("--ts-workers", type=int, default=2, help="TorchServe handler processes (default 2)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-batch-delay-ms", type=int, default=1)
    p.add_argument("--ps-shards", type=int, default=0, help="PS processes (default: as trained, 2)")
    p.add_argument(
        "--runs",
        default=",".join(RUNS),
        help=f"frontend:lookups pairs (default {','.join(RUNS)}); a lean "
        "run may add :<ms>, its --batch-wait-ms (lean:colocated:0 runs without micro-batching)",
    )
    p.add_argument(
        "--batch-wait-ms", type=float, default=1.0, help="the lean runs' micro-batching wait (0: off)"
    )
    p.add_argument("--forms", default="records,columns", help="request forms, each run in turn on the same "
                   "server: records (a list of flat records), columns (a ranking request in column form)")  # fmt: skip
    p.add_argument("--columns", action="store_true", help="the column form only (--forms columns)")
    p.add_argument(
        "--workers", default="1,2", help="recserve serve --workers counts, in turn ('' skips them)"
    )
    p.add_argument("--workers-rates", default="50,100,200,300,400,500,600,700,800,1000",
                   help="requests/s stepped up to each count's max rate at p99 <= 10 ms")  # fmt: skip
    p.add_argument("--workers-step", type=float, default=25.0,
                   help="then bisect between each form's last rate held and first missed, to this many "
                        "requests/s (0: the stepped rates only)")  # fmt: skip
    p.add_argument("--open-rates", default="10,50", help="the open loop's requests/s ('' skips it)")
    p.add_argument("--median-runs", type=int, default=100,
                   help="calls each sequential median (in-process reference, stages) times at least")  # fmt: skip
    p.add_argument("--median-s", type=float, default=1.0, help="seconds each sequential median runs at least")
    p.add_argument("--out", default="e2e", help="results name: loadtest/results/<out>.json")
    args = parse(p, argv, {"rates": "10", "duration": 1.0, "warmup_s": 1.0, "workers_rates": "50", "workers_step": 0.0,
                           "runs": "lean:colocated,torchserve:remote", "median_runs": 10, "median_s": 0.0})  # fmt: skip
    rates = numbers(args.rates)
    forms = ["columns"] if args.columns else args.forms.split(",")
    if not forms or set(forms) - {"records", "columns"}:
        p.error(f"--forms takes records and/or columns, not {args.forms!r}")
    pairs = [(*r.split(":")[:2], float(r.split(":")[2]) if r.count(":") == 2 else args.batch_wait_ms)
             for r in args.runs.split(",") if r]  # fmt: skip

    import model_store

    work = Path(tempfile.mkdtemp(prefix="bench-e2e-"))
    try:
        store = given_or_trained(args.store, work)
        current = model_store.current(store, args.model)
        if current is None:
            raise RuntimeError(f"{store}: no published version of {args.model}")
        vdir = model_store.version_dir(store, args.model, current)
        bodies = {form: request_bodies(form == "columns") for form in forms}
        reference = {form: inprocess_p50_ms(vdir, b, sampling(args)) for form, b in bodies.items()}
        for form, (p50, decode) in reference.items():
            print(f"in one process, {form}: p50 {p50} ms, decode {decode} ms", flush=True)
        load_before = os.getloadavg()
        runs = [x for f, lk, wait in pairs for x in run_one(args, f, lk, store, rates, bodies, work, wait)]
        counts = [int(n) for n in args.workers.split(",") if n]
        workers, open_loop = workers_section(args, store, numbers(args.workers_rates), counts, bodies, work,
                                             numbers(args.open_rates))  # fmt: skip
        load_after = os.getloadavg()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def run(frontend: str, lookups: str, form: str) -> dict | None:  # the first such (default batch wait)
        return next(
            (r for r in runs if (r["frontend"], r["lookups"], r["form"]) == (frontend, lookups, form)), None
        )

    checks = {"no_failures": all(r["failures"] == 0 for x in runs for r in x["rates"].values())}
    for form in forms:
        lean, ts = run("lean", "colocated", form), run("torchserve", "colocated", form)
        if lean is not None and "50" in lean["rates"]:
            checks[f"{form}: lean_colocated_p99_at_50_le_6ms"] = (
                lean["rates"]["50"]["p99_ms"] <= TARGETS["lean_p99_ms_at_50"]
            )
        if lean is not None and "10" in lean["rates"]:
            checks[f"{form}: lean_colocated_p50_at_10_le_1.5x_inprocess"] = (
                lean["rates"]["10"]["p50_ms"] <= 1.5 * reference[form][0]
            )
        if lean is not None:
            checks[f"{form}: lean_colocated_holds_200rps_at_p99_le_10ms"] = lean["max_rps_p99_le_10ms"] >= 200
        if ts is not None and "50" in ts["rates"]:
            checks[f"{form}: torchserve_colocated_p99_at_50_le_10ms"] = (
                ts["rates"]["50"]["p99_ms"] <= TARGETS["p99_ms_at_50"]
            )
    checks.update(worker_checks(workers, open_loop))
    out = {
        "inprocess_p50_ms": {form: p50 for form, (p50, _) in reference.items()},
        "decode_p50_ms": {form: decode for form, (_, decode) in reference.items()},
        "runs": runs,
        "workers": workers,
        "open_loop": open_loop,
        "targets": TARGETS,
        "conditions": {
            "duration_s": args.duration,
            "request_items": 200,
            "distinct_requests": {form: len(b) for form, b in bodies.items()},
            "token_auth": {"runs": False, "workers": True, "open_loop": True},
            "workers_step_rps": args.workers_step,
            "runtime": args.runtime,
            "ts_workers": args.ts_workers,
            "batch_size": args.batch_size,
            "max_batch_delay_ms": args.max_batch_delay_ms,
            "request_forms": {"records": "JSON, a list of records", "columns": "JSON, column form"},
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in load_after],
            "note": "load generator (locust) and every serving process share this machine; lean + remote "
            "runs beside an idle TorchServe (the stack that hosts its PS shards and worker)",
        },
    }
    for form, (p50, decode) in reference.items():
        print(
            f"\nin one process (features + tables in memory + dense), {form}: p50 {p50} ms, decode {decode} ms"
        )
    if runs:  # (--runs '': the workers alone)
        print_table(
            f"end to end: locust FastHttpUser, 200-item JSON requests, {args.duration:g} s per rate, token auth off",
            _rate_rows(runs),
            ["run", "rate", "p50_ms", "p99_ms", "max_ms", "requests", "failures", "achieved_rps"],
        )
        print_table(
            "CPU ms per request, by process",
            _rate_rows(runs, "cpu_ms_per_request"),
            ["run", "rate", "locust", "lean", "torchserve_frontend", "handler", "worker", "ps", "total"],
        )  # fmt: skip
        print_table(
            "Server-Timing p50 under load (ms) and the rest of each request",
            _rate_rows(runs, "server_timing_p50_ms"),
            ["run", "rate", "decode", "worker", "dense", "encode", "total", "outside_handler", "outside_handler_p99"],
        )  # fmt: skip
        for x in runs:
            if x["stages_ms"]:
                print_table("stages (sequential medians, ms)", [{"stage": k, "ms": v} for k, v in x["stages_ms"].items()],
                            ["stage", "ms"])  # fmt: skip
        print("\nmax rate with p99 <= 10 ms and no failures: "
              + ", ".join(f"{_name(x)} {x['max_rps_p99_le_10ms']:g}" for x in runs))  # fmt: skip
    print_workers(workers, open_loop)
    print("targets:")
    report_targets(out, checks)
    path = write_results(args.out, out, args.results_dir)
    print(f"load average before/after the load runs: {load_before[0]:.2f}/{load_after[0]:.2f} "
          f"on {os.cpu_count()} cpus")  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
