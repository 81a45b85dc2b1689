"""``make bench-stream``: learning from the stream, end to end, with a trainer and a joiner killed.

    python -m loadtest.bench_stream [--minutes 5] [--rate 25] [--items 200] [--quick] [--results-dir DIR] [--store DIR]

On the mock Kafka cluster (``loadtest.mockbroker``, a process of its own): ``recserve serve``
+ co-located lookups with ``--log-impressions``, loaded at ``--rate`` requests/s of one request of
``--items`` items (200; the same items every time, so an item's taste can be learnt); simulated users
(``loadtest.stream_users``) clicking in a drifting world (each item's taste rises and falls once
every ``--drift-period-s``: popular items fall out of fashion and others rise); ``recserve join``;
the streaming trainer ``recserve train --follow --stream`` at the online learning rate ``--lr`` and
``--batch-size`` samples a step, publishing a delta into the served version every
``--delta-interval-s``. A third of the way in the trainer is SIGKILLed and restarted, two thirds in the joiner. Then the load stops, the joiner and
the trainer catch up, and everything is counted against the impression log: every impression
whose join window closed before the end (``window_s`` before the last impression) must be trained
exactly once -- ``lost_samples`` (never trained) and ``duplicate_samples`` (trained twice): each
delta's record (its offsets and the samples it says it trained) against the keys of the samples
its offsets hold, new ones only (``loadtest.stream_figures.exactly_once``; the trainer remembers
keys for ``--dedup-window-s``, which covers the join window and a restarted joiner's replay). The
impressions and samples topics are read as they fill, from the start (the mock cluster keeps only
a few MB a partition); the joiner and the users produce in batches of ``stream_topics.LINGER_MS``
(the mock cluster answers a fetch with one batch a partition). The figures come from those facts
(``loadtest.stream_figures``):

- ``progressive_auc``: ``streaming``, each sample scored by the trainer before it trains (the
  deltas' records); ``frozen``, the version served at the start scoring the same samples, delta by
  delta (its scores of the 200 items, read from a response before the first delta); both weighted
  by the deltas' samples.
- ``event_to_served_s`` {p50, p99}: from a click's produce time to the first response scored with
  the delta that trained its sample (the delta's offsets place the sample; responses name their
  delta), over the clicks of the load (it starts once the joiner and the trainer are at work)
  outside the kills' windows, ``KILL_GUARD_S`` before each kill to ``RECOVERY_TARGET_S`` after
  (``stream_figures.served_figures``); ``..._all`` and ``..._by_phase`` say the rest (a phase
  from a kill holds the clicks from ``KILL_GUARD_S`` before it). ``event_to_served_parts_s``: the
  clicks of ``event_to_served_s`` to their joined sample's produce time and to their delta's record.
- ``recovery_s`` {trainer, joiner}: seconds from each kill until the loop's lag (the trainer's, below,
  plus the samples the joiner owes) is back under one second of traffic (``--rate`` x ``--items``
  samples) and stays there until the next kill or the load's end (``stream_figures.recovery_s``;
  None: not recovered, a missed target). ``back_under_s``: until it first fell back under the line
  after the kill's first look over it (the kill's own setback; ``recovery_s`` also waits out the
  steady state's looks over the line before the next event).
- ``max_lag_samples``: the most samples the trainer's published offsets (its last delta's) were
  behind the samples topic's end, sampled every second (the kill's restart included);
  ``max_samples_dropped_by_the_broker_before_trained``: how far the broker's retention had passed
  the trainer's offsets (lost samples; 0 while the trainer keeps within it);
  ``max_lag_samples_trainer_gauge``: the most the trainer's own lag gauge said (its /metrics,
  ``recserve_follow_lag_samples``; None for a trainer without it). ``max_owed_by_the_joiner``: the
  most samples of closed windows not written yet (``stream_figures.owed_by_the_joiner``).
  ``lag_samples``: [seconds since the load's start, the trainer's lag, the joiner's owed] a look.
- ``cpu_pct``: over the load and the ``RECOVERY_TARGET_S`` after each kill, each process's CPU in
  % of one CPU (``loadtest.series``: the frontend, its twin, the broker, the joiner, the trainer
  and its standby, the bench's own process, which sends the load, plays the users and reads both
  topics), the whole machine's and ``others``' (the machine's less theirs: anything else running).
- ``logging_p99_ratio``: after the stream, the same frontend (log on) and a twin over the same
  store without the log (off) at ``--log-rate`` requests/s, in turns of ``--log-phase-s``
  (``--log-rounds`` each, ABBA), p99 of each side's pooled latencies, on / off.

Writes ``loadtest/results/stream.json``. ``--quick``: 0.4 minutes at 4 rps (checks the bench, its
figures mean little).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import orjson

import model_store as ms
from loadtest import mockbroker
from loadtest import stream_figures as sf
from loadtest.common import (
    CRITEO_SCHEMA,
    CRITEO_TEST,
    given_or_trained,
    keep_work_flag,
    parse,
    parser,
    report_targets,
    work_dir,
    write_results,
)
from loadtest.drive import lean_frontend, warm_up
from loadtest.paced import Paced, interleaved
from loadtest.processes import tree
from loadtest.series import Series
from loadtest.stream_roles import (
    Looks,
    alive,
    guard_warmup,
    input_guard_warmup,
    kill,
    port_of,
    standby_flag,
    start,
    trained_offsets,
    trainer_roles,
    until_ready,
)
from loadtest.stream_topics import (
    JOINER_KAFKA_BATCHED,
    JOINER_MEMBER,
    LINGER_MS,
    TOPICS,
    Collector,
    high_watermarks,
    impression_facts,
    joiner_role,
    sample_facts,
)
from loadtest.stream_users import UserModel, play
from model_store.deltas import DeltaManifest, read_delta
from model_store.dense import AUTO
from serving.rpc.procs import free_ports, stop_children
from serving.scoring.client import requests_from_file

LOG_RATIO_TARGET = 1.15
ROLES = ("joiner", "trainer", "trainer-standby")
KILL_GUARD_S = 2.0
"""Clicks produced this long before a kill count in the kill's phase: a click a second before the
trainer dies is trained by the restarted one, so its wait is the restart's."""


def version_dir(model_dir: Path) -> Path:
    version = ms.current(model_dir.parent, model_dir.name)
    if version is None:
        raise RuntimeError(f"{model_dir}: no current version")
    return ms.version_dir(model_dir.parent, model_dir.name, version)


def published(model_dir: Path) -> list[tuple[int, Path, DeltaManifest]]:
    """(seq, directory, DELTA.json record) of every published delta of the current version."""
    vdir = version_dir(model_dir)
    out = []
    for seq in ms.list_deltas(vdir):
        d = ms.delta_dir(vdir, seq)
        if (record := read_delta(d)) is not None:
            out.append((seq, d, record))
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--store", help="existing model store (default: train one into a temp dir)")
    p.add_argument("--model", default="criteo")
    p.add_argument("--minutes", type=float, default=5.0, help="minutes of load (default: 5)")
    p.add_argument("--rate", type=float, default=25.0, help="requests/s (default: 25)")
    p.add_argument(
        "--items", type=int, default=200, help="items per request, the first Criteo test rows (default: 200)"
    )
    p.add_argument("--window-s", type=float, default=10.0, help="the joiner's window (default: 10)")
    p.add_argument("--drift-period-s", type=float, default=60.0,
                   help="seconds for an item's taste to go round once (default: 60)")  # fmt: skip
    p.add_argument(
        "--drift-weight", type=float, default=2.0, help="logit amplitude of the taste (default: 2)"
    )
    p.add_argument("--lr", type=float, default=0.05,
                   help="the streaming trainer's sparse learning rate (default: 0.05, 10x the offline one)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=1024,
                   help="the streaming trainer's samples per step (default: 1024, for 5,000 samples/s)")  # fmt: skip
    p.add_argument("--delta-interval-s", type=float, default=0.5, help="(default: 0.5)")
    p.add_argument("--dedup-window-s", type=float, default=60.0,
                   help="the trainer's dedupe window (default: 60, the join window and a joiner's replay)")  # fmt: skip
    p.add_argument("--log-rate", type=float, default=50.0, help="requests/s of the log on/off phases")
    p.add_argument("--log-phase-s", type=float, default=10.0, help="seconds of one log on/off phase")
    p.add_argument("--log-rounds", type=int, default=6, help="log on/off phases of each side")
    standby_flag(p)
    keep_work_flag(p)
    p.add_argument("--catch-up-s", type=float, default=300.0, help="most seconds to catch up at the end")
    args = parse(p, argv, {"minutes": 0.4, "rate": 4.0, "window_s": 4.0, "drift_period_s": 12.0,
                           "catch_up_s": 90.0, "log_rate": 10.0, "log_phase_s": 2.0, "log_rounds": 2})  # fmt: skip
    with work_dir("bench-stream", args.keep_work) as work:
        store = given_or_trained(args.store, work)
        served = work / "served"
        shutil.copytree(store, served)
        out = run(args, served / args.model, work, args.minutes * 60)
    report_targets(out, sf.targets(out, LOG_RATIO_TARGET))
    print({k: v for k, v in out.items() if k not in ("conditions", "lag_samples")})
    path = write_results("stream", out, args.results_dir)
    print(f"wrote {path}")
    return 0


def run(args, model_dir: Path, work: Path, duration: float) -> dict:
    from confluent_kafka import Consumer

    body = next(requests_from_file(str(CRITEO_TEST), str(CRITEO_SCHEMA), args.items))[0]
    vdir = version_dir(model_dir)
    with contextlib.ExitStack() as es:
        broker = es.enter_context(mockbroker.running([mockbroker.TopicSpec(t, n) for t, n in TOPICS.items()]))
        b = broker.bootstrap
        log = ("--log-impressions", f"kafka://{b}/impressions")
        endpoint, lean = es.enter_context(lean_frontend(model_dir.parent, args.model, "colocated", None, work,
                                                        AUTO, 1.0, log))  # fmt: skip
        (work / "off").mkdir()  # its twin without the log, over the same store (deltas and all)
        twin, lean_off = es.enter_context(lean_frontend(model_dir.parent, args.model, "colocated", None,
                                                        work / "off", AUTO, 1.0))  # fmt: skip
        frozen_scores, seq0 = first_scores(endpoint, body)
        train = ["train", "--follow", str(model_dir), "--stream", f"kafka://{b}/samples", "--delta-interval-s",
                 f"{args.delta_interval_s:g}", "--lr", f"{args.lr:g}", "--dedup-window-s", f"{args.dedup_window_s:g}",
                 "--batch-size", str(args.batch_size), *guard_warmup(args.window_s, args.rate * args.items)]  # fmt: skip
        roles = {"joiner": joiner_role(b, args.window_s, "bench-stream", work, JOINER_KAFKA_BATCHED)
                 + input_guard_warmup(args.window_s, args.rate * args.items)}  # fmt: skip
        roles |= trainer_roles(train, free_ports(2), args.standby)
        procs: dict = {}
        for name in ("joiner", "trainer"):  # the standby once the trainer reads (until_ready)
            start(roles, procs, work, name)
        es.callback(lambda: stop_children([p for p in procs.values() if p.poll() is None]))
        model = UserModel(delay_s=2.0, drift_weight=args.drift_weight, drift_period_s=args.drift_period_s)
        clicks, stop_users = sf.Clicks(), threading.Event()
        users = threading.Thread(
            target=play,
            args=(b, model, stop_users),
            kwargs={"on_sent": clicks, "linger_ms": LINGER_MS},
            daemon=True,
        )
        users.start()
        collectors = {"impressions": Collector(b, "impressions", impression_facts),
                      "samples": Collector(b, "samples", sample_facts)}  # fmt: skip
        for c in collectors.values():
            c.start()
        watch = Consumer({"bootstrap.servers": b, "group.id": "bench-watch"})
        looks = Looks(watch, vdir, lambda: port_of(roles["trainer"]))
        kills: dict[str, float] = {}
        print(f"load {args.rate:g} rps for {duration:.0f} s; trainer killed at {duration / 3:.0f} s, "
              f"joiner at {2 * duration / 3:.0f} s", flush=True)  # fmt: skip
        until_ready(roles, procs, work)
        named = {"frontend": tree(lean["lean"][0]), "frontend_off": tree(lean_off["lean"][0]),
                 "broker": lambda: [broker.proc.pid], "bench": lambda: [os.getpid()]}  # fmt: skip
        series = Series(lambda: {n: f() for n, f in named.items()} | {n: [r.pid] for n, r in dict(procs).items()},
                        model_dir, 2.0)  # fmt: skip
        series.start()
        es.callback(series.halt)
        t0, wall0, loadavg = time.monotonic(), time.time(), [os.getloadavg()]
        with Paced(endpoint, body, args.rate) as load:
            for at, name in ((duration / 3, "trainer"), (2 * duration / 3, "joiner"), (duration, "")):
                while (left := t0 + at - time.monotonic()) > 0:
                    time.sleep(min(1.0, left))
                    looks.look()
                    alive(procs, work)
                if name:
                    kills[name] = time.time()
                    kill(roles, procs, work, name)
                    print(f"  {time.monotonic() - t0:.0f} s: {name} SIGKILLed, restarted", flush=True)
        load_s, load_end = time.monotonic() - t0, time.time()
        loadavg.append(os.getloadavg())
        cpu = sf.cpu_figures(series.cpu_pct, looks.busy, {"load": (wall0, load_end)} | {
            f"after_{n}_kill": (at, min(at + sf.RECOVERY_TARGET_S, load_end)) for n, at in kills.items()})  # fmt: skip
        imps = [i for part in collectors["impressions"].finish(watch) for i in part]
        expected = sf.expected_keys(imps, args.window_s)
        catch_up_s = catch_up(args, watch, vdir, load_s + t0, expected, collectors["samples"])
        stop_users.set()
        stop_children([p for n, p in procs.items() if n != "joiner"], 60)  # SIGTERM: a last delta
        samples = sf.SampleLog.cat(collectors["samples"].finish(watch))
        watch.close()
        users.join(30)
        stop_children([procs["joiner"]])
        print(
            f"log on / off at {args.log_rate:g} rps, {args.log_rounds} x {args.log_phase_s:g} s each",
            flush=True,
        )
        for e in (endpoint, twin):
            warm_up(e, None, [body], 2.0)
        sides = interleaved(
            {"off": twin, "on": endpoint}, body, args.log_rate, args.log_phase_s, args.log_rounds
        )
    responses = load.responses()
    deltas = published(model_dir)
    records = [r for _, _, r in deltas]
    n_trained = sum(r.samples for r in records)
    where = sf.delta_index(samples, records, "samples")
    first = sf.first_trained(samples, where)
    counted = sf.exactly_once(samples, where, first, records, expected)
    auc = sf.progressive_auc(samples, where, first, records, frozen_scores)
    t_click, e2s, unserved = sf.event_to_served(clicks.arrays(), samples, where, first,
                                                np.array([s for s, _, _ in deltas], np.int64), responses)  # fmt: skip
    parts = sf.event_to_written(clicks.arrays(), samples, where, first,
                                np.array([r.created for r in records], np.float64))  # fmt: skip
    if args.results_dir:  # each click's parts, for a closer look than percentiles
        Path(args.results_dir).mkdir(parents=True, exist_ok=True)
        np.savez(Path(args.results_dir) / "stream-clicks.npz", served_click=t_click, served_s=e2s,
                 kills=np.array([kills.get("trainer", 0.0), kills.get("joiner", 0.0), wall0]),
                 click=parts["click"], joined=parts["joined"], written=parts["written"])  # fmt: skip
    served = sf.served_figures(t_click, e2s, wall0, load_end, kills, KILL_GUARD_S)
    steady = sf.outside_kills(parts["click"], list(kills.values()), KILL_GUARD_S) & (parts["click"] >= wall0)
    to = {k: v for k, v in parts.items() if k != "click"}
    lag_t, lag_n = np.array([t for t, _ in looks.lags]), np.array([n for _, n in looks.lags], np.int64)
    owed = sf.owed_by_the_joiner(imps, args.window_s, samples, lag_t)
    ends, under = {"trainer": kills.get("joiner", load_end), "joiner": load_end}, args.rate * args.items
    ok = responses.status == 200
    on, off = sides["on"].p99_ms(), sides["off"].p99_ms()
    return {
        "impressions": len(imps),
        "requests": {"ok": responses.ok, "failed": int((~ok).sum())},
        "samples_joined": len(np.unique(samples.keys)),
        "samples_produced": len(samples.keys),
        "samples_trained": n_trained,
        "duplicate_samples": counted.duplicates,
        "lost_samples": counted.lost,
        "lost_samples_never_joined": sf.missing(expected, samples.keys),
        "samples_expected": len(expected),
        "progressive_auc": {"streaming": auc.streaming, "frozen": auc.frozen},
        "progressive_auc_windows": {"deltas": auc.windows, "deltas_whose_samples_differ": auc.samples_differ},
        **served,
        "event_to_served_parts_s": {
            "over": "the clicks of event_to_served_s, from each one's produce time",
            **{f"to_{k}": sf.percentiles_s(v[steady] if len(v) else v) for k, v in to.items()},
        },
        "recovery_s": {n: sf.recovery_s(lag_t, lag_n + owed, at, ends[n], under) for n, at in kills.items()},
        "back_under_s": {
            n: sf.back_under_s(lag_t, lag_n + owed, at, ends[n], under) for n, at in kills.items()
        },
        "clicks_trained_not_served": unserved,
        "logging_p99_ratio": round(on / off, 3) if on and off else None,
        "logging_p99_ms": {"on": on, "off": off, "requests": {k: v.ok for k, v in sides.items()}},
        "join_samples_per_s": round(len(np.unique(samples.keys)) / (load_s + catch_up_s)),
        "train_samples_per_s": round(n_trained / (load_s + catch_up_s)),
        "max_lag_samples": int(lag_n.max(initial=0)),
        "max_owed_by_the_joiner": int(owed.max(initial=0)),
        "lag_samples": [
            [round(t - wall0, 1), int(n), int(o)] for t, n, o in zip(lag_t, lag_n, owed, strict=True)
        ],
        "max_lag_samples_trainer_gauge": int(max(looks.gauge)) if looks.gauge else None,
        "max_samples_dropped_by_the_broker_before_trained": looks.trimmed,
        "deltas": {
            "published": len(deltas),
            "served_at_start": seq0,
            "last_served": int(responses.delta_seq[ok].max(initial=-1)),
            "responses_scored_with_a_delta": int((responses.delta_seq[ok] > seq0).sum()),
            "served_at_end": int(sides["on"].delta_seq.max(initial=-1)),
        },  # fmt: skip
        "identical_requests": len({i[3] for i in imps}) == 1,
        "catch_up_s": round(catch_up_s, 1),
        "peak_rss_bytes": max((sum(x.rss.get(n, 0) for n in ROLES) for x in series.samples), default=0),
        "cpu_pct": cpu,
        "conditions": {
            "frontend": "recserve serve, co-located lookups, --log-impressions",
            "rate_rps": args.rate,
            "request_items": args.items,
            "load_s": round(load_s, 1),
            "window_s": args.window_s,
            "click_delay_s": 2.0,
            "drift_weight": args.drift_weight,
            "drift_period_s": args.drift_period_s,
            "trainer_lr": args.lr,
            "trainer_batch_size": args.batch_size,
            "delta_interval_s": args.delta_interval_s,
            "dedup_window_s": args.dedup_window_s,
            "partitions": TOPICS,
            "joiner_kafka_config": JOINER_KAFKA_BATCHED.strip(),
            "users_linger_ms": LINGER_MS,
            "joiner_member": JOINER_MEMBER,
            "trainer_standby": args.standby,
            "kills": "trainer SIGKILL at 1/3, joiner at 2/3, each restarted at once",
            "frozen": "the start's version: its scores of the 200 items on the samples of each delta",
            "auc": "progressive, per delta, weighted by samples",
            "logging": f"{args.log_rate:g} rps, {args.log_rounds} x {args.log_phase_s:g} s a side, ABBA, "
            "after the stream (joiner, trainer, users stopped); pooled p99",
            "broker": "librdkafka mock cluster, 3 brokers, one process; everything on this machine",
            "loadavg_at_start_and_end_of_load": loadavg,
        },  # fmt: skip
    }


def first_scores(endpoint: str, body: bytes) -> tuple[np.ndarray, int]:
    """The served version's scores of the request's items and its delta seq, before any delta."""
    from serving.scoring.client import ScoringClient

    c = ScoringClient(endpoint, None)
    try:
        status, payload = c.post(body)
    finally:
        c.close()
    if status != 200:
        raise RuntimeError(f"first request failed ({status}): {payload[:300]!r}")
    reply = orjson.loads(payload)
    return np.asarray(reply["scores"], np.float32), int(reply["versions"]["delta_seq"])


def catch_up(args, watch, vdir: Path, load_stop: float, expected: np.ndarray, joined: Collector) -> float:
    """Wait (at most ``--catch-up-s``) until the joiner wrote a sample of every ``expected`` key
    (read by ``joined``) and the trainer's published offsets reached the samples topic's end;
    seconds waited."""
    deadline, complete = load_stop + args.catch_up_s, False
    while time.monotonic() < deadline:
        if not complete and sum(len(p.keys) for p in joined.parts) >= len(expected):
            complete = sf.missing(expected, sf.SampleLog.cat(list(joined.parts)).keys) == 0
        if complete and sum(trained_offsets(vdir)) >= sum(high_watermarks(watch, "samples")):
            break
        time.sleep(1.0)
    return time.monotonic() - load_stop


if __name__ == "__main__":
    raise SystemExit(main())
