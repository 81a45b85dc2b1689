"""``make bench-soak``: the whole loop for half an hour, with the trainer, the joiner and a PS replica killed.

    python -m loadtest.bench_soak [--minutes 30] [--window-min 5] [--rate 50] [--ts-rate 10] [--items 200]
                                  [--full-every 10m] [--quick] [--results-dir DIR] [--store DIR]

On the mock Kafka cluster (``loadtest.mockbroker``): ``recserve serve`` with co-located
lookups at ``--rate`` requests/s, and the local stack (``serving.stack.local``: 2 replicas per PS
shard, the worker, TorchServe with remote lookups, supervised) at ``--ts-rate``, both logging
impressions to one topic and following one model store; a request is always the same ``--items``
Criteo rows (``loadtest.recorder``: every response's time, latency, status and versions). Simulated users
(``loadtest.stream_users``) click in a drifting world, their clicks sent in batches of
``stream_topics.USERS_LINGER_MS`` (200 ms: the mock cluster's cost of a fetch grows with a partition's
message sets); ``recserve join``; the streaming trainer
(``recserve train --follow --stream``) cuts a delta every ``--delta-interval-s`` (0.5) and, with
``--full-every`` (10m; '': none), trains the dense network and publishes a full version that often,
retention keeping ``--keep-versions``. A third of
the way in the trainer is SIGKILLed, half-way the joiner (each restarted at once), two thirds in
a PS replica (``loadtest.bench_faults.kill_and_watch``: the supervisor restarts it).

Then the load stops, the joiner and the trainer catch up, and ``lost_samples`` and
``duplicate_samples`` are counted against the impression log (``loadtest.bench_stream``'s rule:
every impression whose join window closed before the last one trained exactly once, from the
samples topic as read and the records of every delta of every version, read as they land:
``loadtest.published``, ``loadtest.stream_figures``).

Per ``--window-min`` window of the load: ``p50_ms``, ``p99_ms`` (``recserve serve``; TorchServe's
under ``torchserve``), ``failures`` and ``mixed_responses`` (both endpoints), ``event_to_served_s``
{p50, p99} (``loadtest.stream_figures.event_to_served``: a click's produce time to the first
response of either endpoint scored with the delta that trained its sample or a later one, for the
clicks produced in the window; those no response served before the load stopped are counted in
``clicks_unserved``; ``over_2s``: when the clicks served after more than 2 s were produced, as
spans [from, to, clicks] in seconds since the load's start), ``rss_mb`` per process (the mean of its samples in the window), ``cpu_pct``
per process (% of one CPU over the window) and
``store_bytes`` (the model store's disk use at the window's end); over the run also
``impressions_missing`` (answered requests the impression log lacks; the bench reads the log as it
fills, and ``impressions_unread_by_the_bench`` counts those the broker dropped before it read
them, ``samples_unread_by_the_bench`` the samples') and ``store_floor_bytes`` (the
store's fewest bytes under each version CURRENT named, once its publish's retention was done
(``model_store.doomed``: nothing left that ``--keep-versions`` deletes; null where it was still
deleting when the run ended). Writes
``loadtest/results/soak.json``. ``--quick``: 0.6 minutes at 4 + 2 rps in 0.2-minute windows.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

import model_store as ms
from loadtest import mockbroker
from loadtest import stream_figures as sf
from loadtest.bench_faults import KILLED_PS, kill_and_watch
from loadtest.common import (
    CRITEO_SCHEMA,
    CRITEO_TEST,
    given_or_trained,
    keep_work_flag,
    parse,
    parser,
    work_dir,
    write_results,
)
from loadtest.drive import lean_frontend
from loadtest.processes import grpc_serving, tree
from loadtest.published import Published
from loadtest.recorder import Recorder, Responses, rid_ints
from loadtest.series import Series
from loadtest.soak_figures import Figures, analyse, report
from loadtest.stream_figures import Clicks, expected_keys
from loadtest.stream_roles import (
    alive,
    guard_warmup,
    input_guard_warmup,
    kill,
    standby_flag,
    start,
    trainer_roles,
    until_ready,
)
from loadtest.stream_topics import (
    JOINER_KAFKA_BATCHED,
    TOPICS,
    USERS_LINGER_MS,
    Collector,
    high_watermarks,
    impression_facts,
    joiner_role,
    sample_facts,
    watermarks,
)
from loadtest.stream_users import UserModel, play
from model_store.dense import AUTO
from serving.rpc.procs import free_ports, stop_children
from serving.scoring.client import requests_from_file

LEAN, TORCHSERVE = 1, 2  # the recorders' request-id streams


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--store", help="existing model store (default: train one into a temp dir)")
    p.add_argument("--model", default="criteo")
    p.add_argument("--minutes", type=float, default=30.0, help="minutes of load (default: 30)")
    p.add_argument("--window-min", type=float, default=5.0, help="minutes per reported window (default: 5)")
    p.add_argument("--rate", type=float, default=50.0, help="recserve serve's requests/s (default: 50)")
    p.add_argument("--ts-rate", type=float, default=10.0, help="TorchServe's requests/s (default: 10)")
    p.add_argument("--items", type=int, default=200,
                   help="items per request, the first Criteo test rows (default: 200: with both frontends' 60 "
                   "requests/s, 12,000 samples/s)")  # fmt: skip
    p.add_argument("--window-s", type=float, default=10.0, help="the joiner's window (default: 10)")
    p.add_argument("--delta-interval-s", type=float, default=0.5, help="the trainer's (default: 0.5)")
    p.add_argument(
        "--batch-size", type=int, default=1024, help="the trainer's samples a step (default: 1024)"
    )
    p.add_argument("--dedup-window-s", type=float, default=60.0,
                   help="the trainer's (default: 60; covers the join window and a restarted joiner's replay)")  # fmt: skip
    p.add_argument("--full-every", default="10m",
                   help="the trainer's --full-every, with --train-dense (default: 10m; '': deltas only)")  # fmt: skip
    p.add_argument("--keep-versions", type=int, default=2,
                   help="the trainer's retention with --full-every (default: 2, CURRENT and the one before)")  # fmt: skip
    p.add_argument("--drift-period-s", type=float, default=120.0, help="(default: 120)")
    p.add_argument("--drift-weight", type=float, default=2.0, help="(default: 2)")
    p.add_argument("--sample-s", type=float, default=5.0, help="how often RSS and disk use are sampled")
    standby_flag(p)
    keep_work_flag(p)
    p.add_argument("--catch-up-s", type=float, default=180.0, help="most seconds to catch up at the end")
    args = parse(p, argv, {"minutes": 0.6, "window_min": 0.2, "rate": 4.0, "ts_rate": 2.0, "window_s": 4.0,
                           "drift_period_s": 12.0, "sample_s": 1.0, "catch_up_s": 90.0,
                           "full_every": "12s"})  # fmt: skip
    with work_dir("bench-soak", args.keep_work) as work:
        served = work / "served"
        shutil.copytree(given_or_trained(args.store, work), served)
        out = run(args, served / args.model, work)
    report(out, args)
    print(f"wrote {write_results('soak', out, args.results_dir)}")
    return 0


def run(args, model_dir: Path, work: Path) -> dict:
    from confluent_kafka import Consumer

    from serving.stack.local import LocalStack, StackConfig
    from serving.stack.state import read_state

    duration = args.minutes * 60
    body = next(requests_from_file(str(CRITEO_TEST), str(CRITEO_SCHEMA), args.items))[0]
    with contextlib.ExitStack() as es:
        broker = es.enter_context(mockbroker.running([mockbroker.TopicSpec(t, n) for t, n in TOPICS.items()]))
        b = broker.bootstrap
        log_to = f"kafka://{b}/impressions"
        print("starting the local stack (2 PS replicas a shard, TorchServe, remote lookups) ...", flush=True)
        stack = LocalStack(StackConfig(store=str(model_dir.parent), model=args.model, run_dir=str(work / "run"),
                                       replicas=2, lookups="remote", http_port=0, management_port=0,
                                       metrics_port=0, disable_token_auth=True, poll_s=0.2,
                                       log_impressions=log_to)).start()  # fmt: skip
        es.callback(stack.stop)
        endpoint, lean = es.enter_context(lean_frontend(model_dir.parent, args.model, "colocated", None, work, AUTO,
                                                        1.0, ("--log-impressions", log_to, "--poll-s", "0.2")))  # fmt: skip
        train = ["train", "--follow", str(model_dir), "--stream", f"kafka://{b}/samples", "--delta-interval-s",
                 f"{args.delta_interval_s:g}", "--dedup-window-s", f"{args.dedup_window_s:g}", "--batch-size",
                 str(args.batch_size)]  # fmt: skip
        if args.full_every:
            train += ["--train-dense", "--full-every", args.full_every, "--keep-versions", str(args.keep_versions)]  # fmt: skip
        items_per_s = (args.rate + args.ts_rate) * args.items
        train += guard_warmup(args.window_s, items_per_s)
        roles = {"joiner": joiner_role(b, args.window_s, "bench-soak", work, JOINER_KAFKA_BATCHED)
                 + input_guard_warmup(args.window_s, items_per_s)}  # fmt: skip
        roles |= trainer_roles(train, free_ports(2), args.standby)
        procs: dict = {}
        for name in ("joiner", "trainer"):  # the standby once the trainer reads (until_ready)
            start(roles, procs, work, name)
        es.callback(lambda: stop_children([p for p in procs.values() if p.poll() is None]))
        until_ready(roles, procs, work)

        def pids() -> dict[str, list[int]]:
            stacked = read_state(stack.run_dir).pids
            out = {name: [pid] for name, pid in stacked.items() if name != "torchserve"}
            out |= {"torchserve": tree(stacked["torchserve"])(), "lean": tree(lean["lean"][0])(),
                    "broker": [broker.proc.pid], "bench": [os.getpid()]}  # fmt: skip
            return out | {name: [p.pid] for name, p in procs.items()}

        model = UserModel(delay_s=2.0, drift_weight=args.drift_weight, drift_period_s=args.drift_period_s)
        clicks, stop_users = Clicks(), threading.Event()
        users = threading.Thread(
            target=play,
            args=(b, model, stop_users),
            kwargs={"on_sent": clicks, "linger_ms": USERS_LINGER_MS},
            daemon=True,
        )
        imps, joined = (
            Collector(b, "impressions", impression_facts),
            Collector(b, "samples", sample_facts),
        )
        published = Published(model_dir)
        recorders = [Recorder(endpoint, body, args.rate, LEAN), Recorder(stack.state.endpoint, body, args.ts_rate,
                                                                         TORCHSERVE, clients=2)]  # fmt: skip
        series = Series(pids, model_dir, args.sample_s, args.keep_versions if args.full_every else None)
        watch = Consumer({"bootstrap.servers": b, "group.id": "bench-soak-watch"})
        for t in (users, imps, joined, published, *recorders, series):
            t.start()
        es.callback(series.halt)  # on the way out, before the processes it samples go
        es.callback(stop_users.set)
        print(f"load {args.rate:g} + {args.ts_rate:g} rps for {duration:.0f} s; the trainer killed at "
              f"{duration / 3:.0f} s, the joiner at {duration / 2:.0f} s, {KILLED_PS} at {2 * duration / 3:.0f} s",
              flush=True)  # fmt: skip
        t0, kills, dropped = time.time(), list[dict[str, Any]](), 0
        ps_ready = grpc_serving(stack.state.ps_shards[0][1])
        for at, name in ((duration / 3, "trainer"), (duration / 2, "joiner"), (2 * duration / 3, KILLED_PS),
                         (duration, "")):  # fmt: skip
            while (left := t0 + at - time.time()) > 0:
                time.sleep(min(1.0, left))
                alive(procs, work)  # a role that exits by itself stops the bench with its log's tail
                low, _ = watermarks(watch, "samples")  # the broker's retention past the trainer: lost
                behind = [max(0, lo - pos) for lo, pos in zip(low, published.positions(), strict=True)]
                dropped = max(dropped, sum(behind))
            if name in procs:
                kills.append({"name": name, "kill": time.time()})
                kill(roles, procs, work, name)
            elif name:
                kills.append(kill_and_watch(stack.run_dir, name, lambda _state: ps_ready()))
            if name:
                print(f"  {time.time() - t0:.0f} s: {name} SIGKILLed, restarted", flush=True)
        for r in recorders:
            r.stop.set()
        for r in recorders:
            r.join(60)
        load_end = time.time()
        impressions = [i for part in imps.finish(watch) for i in part]
        expected = expected_keys(impressions, args.window_s)
        catch_up_s = catch_up(args, watch, published, expected, joined, model_dir)
        stop_users.set()
        stop_children([p for n, p in procs.items() if n != "joiner"], 60)  # SIGTERM: a last delta
        published.stop()
        series.halt()
        samples = sf.SampleLog.cat(joined.finish(watch))
        watch.close()
        users.join(30)
    responses = [r.responses() for r in recorders]
    logged = rid_ints([i[0] for i in impressions]) if impressions else np.zeros(0, np.int64)
    # the log is off the request path: the last second's records may still be on their way
    answered = np.concatenate([r.rid[(r.status == 200) & (r.end < load_end - 1.0)] for r in responses])
    records = published.records()
    where = sf.delta_index(samples, records, "samples")
    first = sf.first_trained(samples, where)
    counted = sf.exactly_once(samples, where, first, records, expected)
    figures = Figures(
        samples, where, first, published.codes(), Responses.cat(responses).paced(), clicks.arrays()
    )
    return analyse(args, t0, load_end, responses, figures, series) | {
        "lost_samples": counted.lost,
        "duplicate_samples": counted.duplicates,
        "samples_expected": len(expected),
        "samples_trained": sum(r.samples for r in records),
        "impressions": len(impressions),
        "impressions_missing": int((~np.isin(answered, logged)).sum()),
        "impressions_unread_by_the_bench": imps.skipped,
        "samples_unread_by_the_bench": joined.skipped,
        "deltas": len(records),
        "deltas_missed": published.missed,
        "max_samples_dropped_by_the_broker_before_trained": dropped,
        "versions": sorted({d.version for d in published.deltas}),
        "store_floor_bytes": series.floors(),
        "catch_up_s": round(catch_up_s, 1),
        "kills": [{k: round(v - t0, 2) if k in ("kill", "back") else v for k, v in e.items()} for e in kills],
    }


def catch_up(
    args, watch, published: Published, expected: np.ndarray, joined: Collector, model_dir: Path
) -> float:
    """Wait (at most ``--catch-up-s``) until the joiner wrote a sample of every ``expected`` key,
    the trainer's published offsets (of any version) reached the samples topic's end and, with full
    versions, retention's work was done (``ms.doomed``: a full version published in the load's
    last seconds has its floor measured too); seconds waited."""
    start, complete = time.monotonic(), False
    while time.monotonic() < start + args.catch_up_s:
        if not complete and sum(len(p.keys) for p in joined.parts) >= len(expected):
            complete = sf.missing(expected, sf.SampleLog.cat(list(joined.parts)).keys) == 0
        retained = not args.full_every or not ms.doomed(model_dir.parent, model_dir.name, args.keep_versions)
        if complete and retained and published.offsets() >= sum(high_watermarks(watch, "samples")):
            break
        time.sleep(1.0)
    return time.monotonic() - start


if __name__ == "__main__":
    raise SystemExit(main())
