"""``make bench-attribution``: one joiner over a long attribution window, at a frontend's rate, in
accelerated event time: its memory, and exactly once across a SIGKILL.

    python -m loadtest.bench_attribution [--minutes 90] [--rate 50] [--items 200] [--label-after-s 5]
        [--attribution-s 3600] [--partitions 16] [--trainer] [--store DIR] [--quick] [--results-dir DIR]

``--minutes`` of event time at ``--rate`` requests/s of ``--items`` Criteo items (the impressions of
one ranking request, ``loadtest.stream_users``) and the clicks of users whose delays have a long
tail (``UserModel``: half within about a second, the rest log-normal with a median of two minutes,
some past the attribution window) are produced as fast as one ``recserve join --label-after-s
--attribution-s --state-dir`` (a process of its own, a static member) takes them: event time runs
far faster than the wall clock, and the join runs on event time, so an hour of attribution passes
in minutes. The producer keeps the joiner's backlog under ``BACKLOG`` impressions (the mock cluster
keeps only 5 MB a partition: what the joiner has not read by then is gone). Two fifths in, the
joiner is SIGKILLed and started again on the same state directory.

The samples topic is read as it fills, every sample's (request, item, kind) and label counted,
and held against what the world owes (``figures``): a first label of every item of every request
(``lost_samples``, ``unexpected_samples``), and one positive for every item clicked within the
attribution window -- its first label's if the click came within the first horizon and was read
before the window closed, else a correction (``lost_clicks``, ``clicks_labelled_twice``,
``unexpected_corrections``). ``..._produced_again`` count records the joiner sent twice (at least
once: what a SIGKILL left uncommitted, which the trainer drops by key; no trainer runs here,
bench-stream and bench-delayed count what it trains). The dead-letter topics are read whole at
the end (``dead_letters``: each input's count, the commonest reasons), and each lost click is named
with its request's dead letter, if any (``lost_click_examples``). The joiner's RSS is sampled every second
(``joiner_rss_mb``: the second minute's mean, the last, the max, the mean of each tenth of the
run: past the attribution window it is flat) with its spill on disk at the end.

``--trainer``: the streaming trainer (``recserve train --follow --stream --delayed-feedback fnw``,
a delta a second, over a Criteo version trained first or ``--store``'s) trains the samples as they
come, the producer's pace held to its published offsets too; it is SIGKILLed seven tenths in and
started again. Each published delta's record is then held against the samples topic as read
(``trained``): a sample is placed in the first delta whose offsets pass it, and each delta must
say it trained exactly the keys first placed in it (``trainer.duplicate_samples``,
``trainer.lost_samples``: over (request, item, kind), corrections included).

Writes ``loadtest/results/attribution.json``. ``--quick``: 2 minutes of event time at 20 requests/s
of 20 items (checks the bench, its figures mean little).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import signal
import time
from pathlib import Path

import numpy as np
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer, TopicPartition

import model_store as ms
from loadtest import mockbroker
from loadtest.bench_stream import published, version_dir
from loadtest.common import (
    given_or_trained,
    keep_work_flag,
    parse,
    parser,
    print_table,
    report_targets,
    work_dir,
    write_results,
)
from loadtest.processes import Sampler
from loadtest.stream_roles import scrape
from loadtest.stream_topics import Collector
from loadtest.stream_users import UserModel, impressions, ranking_batch_bytes
from model_store.deltas import read_delta
from serving.rpc.procs import free_ports, spawn, stop_children
from stream.dead_letter import read_headers
from stream.records import encode_event, encode_impression
from stream.sample_batch import KIND_BIT, read_samples, request_ids

BACKLOG = 500
"""Impressions produced but not yet committed by the joiner or counted by the reader of samples, at
most: the mock cluster keeps 5 MB a partition, about 150 impressions of 200 items and the samples
of 50 (16 partitions: 800)."""
TRAINER_BACKLOG = 150
"""Impressions produced and not yet in the trainer's published deltas, at most (``--trainer``): their
samples must stay within the 5 MB a partition the mock keeps until the trainer reads them
(``trainer.dropped_by_the_broker_before_trained``: samples the broker dropped before the offsets of
the trainer's last published delta passed them; it may have read them by then, and
``trainer.lost_samples`` says whether any was never trained)."""
CHUNK = 100
"""Impressions produced at a time (with the clicks up to the last one's time)."""
TOPICS = ("impressions", "events", "samples", "impressions.dead", "events.dead", "samples.quarantine")
WORLD = UserModel(ctr=0.05, delay_s=1.0, fast_share=0.5, tail_median_s=120.0, tail_sigma=2.0)
"""Half the clicks within about a second, the rest log-normal around two minutes (e^2 wide: about
2% after an hour)."""
GROUP = "recserve-join"
"""The joiner's consumer group (its default): its committed offsets are its progress."""


def sample_codes(msgs: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of one batch read from the samples topic (``stream_topics.Collector``'s decode): each
    sample's key as an integer (request number x 2^33 + item x 2 + kind), whether it is positive,
    and the (partition, offset) of its record."""
    s, _ = read_samples([m.value() or b"" for m in msgs])
    rid = request_ids(s.keys).astype(np.int64)
    item = np.frombuffer(s.keys.astype("S4").tobytes(), ">u4").astype(np.int64) & (KIND_BIT - 1)
    part = np.fromiter((m.partition() for m in msgs), np.int32, len(msgs))
    offset = np.fromiter((m.offset() for m in msgs), np.int32, len(msgs))
    where = np.stack([part[s.index], offset[s.index]], axis=1)
    return (rid << 33) + item * 2 + s.kinds, s.labels > 0, where


def all_codes(parts: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``sample_codes`` of every batch read, each array joined."""
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, bool), np.zeros((0, 2), np.int32)
    codes, positive, where = (np.concatenate(a) for a in zip(*parts, strict=True))
    return codes, positive, where


def read_so_far(samples: Collector) -> int:
    """The samples ``samples`` (a ``Collector`` of ``sample_codes``) has read so far."""
    return sum(len(codes) for codes, _, _ in list(samples.parts))


def world(
    n: int, rate: float, items: int, t0: float, seed: int = 0
) -> tuple[list, list[tuple[str, bytes]], np.ndarray, tuple]:
    """The run's impressions (request ids ``0000000000``, ...), their clicks as (key, record) in
    event-time order with their times, and the clicks as (request number, item, ts) arrays."""
    imps = [dataclasses.replace(imp, request_id=f"{i:010d}")
            for i, imp in enumerate(impressions(n, t0, 1.0 / rate, ranking_batch_bytes(items), items, seed))]  # fmt: skip
    rng = np.random.default_rng(seed)
    clicks = [e for imp in imps for e in WORLD.clicks(imp, rng)]
    ts = np.array([e.ts for e in clicks])
    order = np.argsort(ts, kind="stable")
    events = [(clicks[i].request_id, encode_event(clicks[i])) for i in order.tolist()]
    num = np.array([int(e.request_id) for e in clicks], np.int64)
    return imps, events, ts[order], (num, np.array([e.item for e in clicks], np.int64), ts)


def expected(
    items: int, imp_ts: np.ndarray, clicks: tuple, attribution: float
) -> tuple[np.ndarray, np.ndarray]:
    """What the join owes, as key codes: a first label of every item of every request (the
    watermark moves on with the wall clock once both inputs are read, closing the last windows),
    and a positive -- the first label's, or a correction's -- for every item clicked (a click sent:
    up to the last impression's time) within the attribution window."""
    firsts = ((np.arange(len(imp_ts))[:, None] << 33) + np.arange(items) * 2).ravel()
    num, item, ts = clicks
    counted = (ts - imp_ts[num] <= attribution) & (ts <= imp_ts[-1])
    return firsts, np.unique((num[counted] << 33) + item[counted] * 2)


def figures(
    codes: np.ndarray, positive: np.ndarray, firsts: np.ndarray, clicked: np.ndarray
) -> dict[str, int]:
    """Lost, unexpected and repeated records against what the join owes (``expected``)."""
    keys, first_at, counts = np.unique(codes, return_index=True, return_counts=True)
    label, corr = keys[(keys & 1) == 0], keys[(keys & 1) == 1] - 1
    positive_first = label[positive[first_at][(keys & 1) == 0]]
    return {
        "lost_samples": int(np.isin(firsts, label, invert=True).sum()),
        "unexpected_samples": int(np.isin(label, firsts, invert=True).sum()),
        "samples_produced_again": int((counts[(keys & 1) == 0] - 1).sum()),
        "clicks_expected": len(clicked),
        "clicks_labelled_at_once": len(positive_first),
        "corrections": len(corr),
        "lost_clicks": int(np.isin(clicked, np.concatenate([positive_first, corr]), invert=True).sum()),
        "clicks_labelled_twice": int(np.isin(corr, positive_first).sum()),
        "unexpected_corrections": int(np.isin(corr, clicked, invert=True).sum()),
        "corrections_produced_again": int((counts[(keys & 1) == 1] - 1).sum()),
    }


def trained(codes: np.ndarray, where: np.ndarray, records: list, partitions: int) -> dict[str, int]:
    """The published deltas' records against the samples topic as read: each record is placed in
    the first delta whose offsets (where its successor resumes) pass it, each key's first copy so
    placed is new there, and a delta that says it trained more samples than the new keys placed
    in it trained some twice, fewer lost some (as are keys no delta reached)."""
    pos = np.array(
        [[r.positions.get(f"samples/{p}", 0) for p in range(partitions)] for r in records], np.int64
    )
    pos = np.maximum.accumulate(pos.reshape(-1, partitions), axis=0)
    delta = np.full(len(codes), len(records), np.int64)
    for p in range(partitions):  # a loop per partition: the records of each at once
        at = where[:, 0] == p
        delta[at] = np.searchsorted(pos[:, p], where[at, 1], side="right")
    order = np.argsort(delta, kind="stable")
    _, first = np.unique(codes[order], return_index=True)
    placed = np.bincount(delta[order][first], minlength=len(records) + 1)
    said = np.array([r.samples for r in records] + [0], np.int64)
    return {"samples_trained": int(said.sum()), "deltas": len(records),
            "duplicate_samples": int(np.maximum(0, said - placed).sum()),
            "lost_samples": int(np.maximum(0, placed - said).sum())}  # fmt: skip


def trainer_positions(model_dir: Path, partitions: int) -> np.ndarray:
    """Per partition of the samples topic, where the trainer's last published delta resumes."""
    vdir = version_dir(model_dir)
    for seq in reversed(ms.list_deltas(vdir)):  # the newest with its record (one cut may lack it)
        if (record := read_delta(ms.delta_dir(vdir, seq))) is not None:
            return np.array([record.positions.get(f"samples/{p}", 0) for p in range(partitions)], np.int64)
    return np.zeros(partitions, np.int64)


def trimmed(watch: Consumer, at: np.ndarray) -> int:
    """Samples the broker dropped (its retention) before the offsets ``at`` reached them."""
    low = [watch.get_watermark_offsets(TopicPartition("samples", p), timeout=5)[0] for p in range(len(at))]
    return int(np.maximum(0, np.array(low) - at).sum())


def model_to_follow(args: argparse.Namespace, work: Path) -> Path | None:
    """With ``--trainer``, the model it follows: a copy of ``--store``'s, else one trained now."""
    if not args.trainer:
        return None
    if args.store:
        shutil.copytree(args.store, work / "store")
    return given_or_trained(str(work / "store") if args.store else None, work) / "criteo"


def trainer_argv(model_dir: Path, bootstrap: str, args: argparse.Namespace) -> list[str]:
    """The streaming trainer over the samples topic: fake negative weighting, a delta a second, a
    dedupe window of what a restarted joiner sends again (the open windows: its journal has the
    rest) with room, its output guard off (the bench counts samples, not a model's judgement)."""
    return ["train", "--follow", str(model_dir), "--stream", f"kafka://{bootstrap}/samples", "--delta-interval-s", "1",
            "--batch-size", "1024", "--dedup-window-s", f"{max(600.0, 20 * args.label_after_s):g}",
            "--delayed-feedback", "fnw", "--no-output-guard"]  # fmt: skip


def lost_clicks(codes: np.ndarray, positive: np.ndarray, clicked: np.ndarray, clicks: tuple, imp_ts: np.ndarray,
                label_after_s: float, dead: dict[str, str], most: int = 10) -> list[dict[str, object]]:  # fmt: skip
    """The first ``most`` clicks no positive came out for, to find why: the request's number, the
    item, its impression's event time from the run's first, the click's delay (its first one), and
    the reason of a dead letter of its request (``dead``: request id -> reason; "" none)."""
    got = codes[positive | ((codes & 1) == 1)] & ~np.int64(1)  # positives' keys as first labels
    lost = clicked[np.isin(clicked, got, invert=True)][:most]
    num, item, ts = clicks
    out = []
    for code in lost.tolist():  # a loop per lost click: a handful
        r, i = code >> 33, (code >> 1) & ((1 << 32) - 1)
        delay = float((ts[(num == r) & (item == i)] - imp_ts[r]).min())
        out.append({"request": r, "item": i, "impression_s": round(float(imp_ts[r] - imp_ts[0]), 3),
                    "delay_s": round(delay, 3), "after_first_horizon": delay > label_after_s,
                    "dead_letter": dead.get(f"{r:010d}", "")})  # fmt: skip
    return out


def dead_letters(bootstrap: str, partitions: int) -> dict:
    """The joiner's dead letters, read whole: how many of each input, the commonest reasons (up to
    the first quote: a reason names its request), and the request of each (``lost_clicks`` looks
    its lost clicks up there)."""
    c = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": "bench-attribution-dead", "enable.auto.commit": False}
    )
    c.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t in ("impressions.dead", "events.dead") for p in range(partitions)])  # fmt: skip
    counts = {"impressions.dead": 0, "events.dead": 0}
    reasons: dict[str, int] = {}
    by_request: dict[str, str] = {}
    quiet = time.time() + 5
    while time.time() < quiet:
        for m in c.consume(10_000, timeout=0.5):  # a loop per dead letter: a handful expected
            if m.error() is not None:
                continue
            quiet = time.time() + 2
            reason = read_headers(m.headers()).get("reason", "")  # type: ignore[arg-type]  # as produced: a list
            counts[str(m.topic())] += 1
            reasons[reason.split("'")[0]] = reasons.get(reason.split("'")[0], 0) + 1
            by_request[(m.key() or b"").decode()] = reason
    c.close()
    common = dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:5])
    return {**counts, "reasons": common, "by_request": by_request}


def committed(bootstrap: str, partitions: int) -> int:
    """Impressions the joiner's group committed (its offsets summed; -1 while it cannot tell)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": GROUP})
    try:
        tps = c.committed([TopicPartition("impressions", p) for p in range(partitions)], timeout=5)
        return sum(max(tp.offset, 0) for tp in tps)
    except KafkaException:
        return -1
    finally:
        c.close()


def run(args: argparse.Namespace) -> dict:
    n = int(args.minutes * 60 * args.rate)
    imps, events, ev_ts, clicks = world(n, args.rate, args.items, 1.7e9)
    imp_ts = np.array([i.ts for i in imps])
    with work_dir("bench-attribution", args.keep_work) as work, mockbroker.running() as broker:
        b = broker.bootstrap
        for t in TOPICS:
            broker.create_topic(t, args.partitions)
        port = free_ports(1)[0]
        argv = ["join", "--brokers", b, "--member", "0/1", "--label-after-s", str(args.label_after_s),
                "--attribution-s", str(args.attribution_s), "--state-dir", str(work / "state"),
                "--metrics-port", str(port)]  # fmt: skip
        procs = [spawn(argv, work / "join.log")]
        model_dir = model_to_follow(args, work)
        train = trainer_argv(model_dir, b, args) if model_dir is not None else []
        trainers = [spawn(train, work / "train.log")] if train else []
        samples = Collector(b, "samples", sample_codes, args.partitions)
        samples.start()
        producer = Producer({"bootstrap.servers": b, "linger.ms": 20, "enable.idempotence": True,
                             "queue.buffering.max.messages": 2_000_000})  # fmt: skip
        killed_at, trainer_killed_at, sent_ev, dropped, t0 = None, None, 0, 0, time.time()
        watch = Consumer({"bootstrap.servers": b, "group.id": "bench-attribution-watch"})
        with Sampler(lambda: [procs[-1].pid], interval_s=1.0) as sampler:
            for start in range(0, n, CHUNK):
                while start - min(committed(b, args.partitions), read_so_far(samples) // args.items) > BACKLOG or (
                        model_dir is not None and start - trainer_positions(model_dir, args.partitions).sum()
                        // args.items > TRAINER_BACKLOG):  # fmt: skip
                    time.sleep(0.1)  # the producer's pace: the joiner, the reader (and the trainer) catch up
                if model_dir is not None:
                    dropped = max(dropped, trimmed(watch, trainer_positions(model_dir, args.partitions)))
                chunk = imps[start : start + CHUNK]
                for imp in chunk:
                    producer.produce("impressions", encode_impression(imp), imp.request_id.encode())
                upto = int(np.searchsorted(ev_ts, chunk[-1].ts, "right"))
                for key, value in events[sent_ev:upto]:
                    producer.produce("events", value, key.encode())
                sent_ev = upto
                producer.flush(60)
                if killed_at is None and start >= 0.4 * n:
                    procs[-1].send_signal(signal.SIGKILL)
                    procs[-1].wait()
                    killed_at = time.time()
                    procs.append(spawn(argv, work / "join-2.log"))
                if train and trainer_killed_at is None and start >= 0.7 * n:
                    trainers[-1].send_signal(signal.SIGKILL)
                    trainers[-1].wait()
                    trainer_killed_at = time.time()
                    trainers.append(spawn(train, work / "train-2.log"))
            firsts, clicked = expected(args.items, imp_ts, clicks, args.attribution_s)
            settled, last = 0, -1
            deadline = time.time() + 600
            while settled < 3 and time.time() < deadline:  # every window closed, every sample read
                time.sleep(1.0)  # the pace of the check: the joiner's last windows and the reader
                read = read_so_far(samples)
                done = scrape(port, "recserve_join_open_windows") == 0 and read == last
                done = done and (
                    model_dir is None
                    or trainer_positions(model_dir, args.partitions).sum() == sum(samples.next)
                )
                settled, last = (settled + 1 if done else 0), read
        wall = time.time() - t0
        parts = samples.finish(watch)
        watch.close()
        stop_children(procs + trainers)
        records = [r for _, _, r in published(model_dir)] if model_dir is not None else []
        dead = dead_letters(b, args.partitions)
        spill_mb = sum(f.stat().st_size for f in (work / "state").rglob("*.seg")) / 2**20
    codes, positive, where = all_codes(parts)
    counted: dict[str, object] = {**figures(codes, positive, firsts, clicked)}
    by_request = dead.pop("by_request")
    counted["lost_click_examples"] = lost_clicks(codes, positive, clicked, clicks, imp_ts, args.label_after_s,
                                                 by_request)  # fmt: skip
    counted["dead_letters"] = dead
    if train:
        counted["trainer"] = trained(codes, where, records, args.partitions) | {
            "killed_at_s": round(trainer_killed_at - t0, 1) if trainer_killed_at else None,
            "dropped_by_the_broker_before_trained": dropped}  # fmt: skip
    rss = np.array([(t, u.rss_bytes / 2**20) for t, u in sampler.samples if u.rss_bytes]).reshape(-1, 2)
    second = rss[(rss[:, 0] >= t0 + 60) & (rss[:, 0] < t0 + 120), 1]
    return {
        "requests": n, "items": args.items, "rate": args.rate, "event_minutes": args.minutes,
        "label_after_s": args.label_after_s, "attribution_s": args.attribution_s, "wall_s": round(wall, 1),
        "first_labels_expected": len(firsts), **counted,
        "joiner_rss_mb": {"second_minute": round(float(second.mean()), 1) if len(second) else None,
                          "last": round(float(rss[-1, 1]), 1) if len(rss) else None,
                          "max": round(float(rss[:, 1].max()), 1) if len(rss) else None,
                          "by_tenth": [round(float(t[:, 1].mean()), 1) for t in np.array_split(rss, 10) if len(t)]},
        "spill_mb_at_end": round(spill_mb, 1), "killed_at_s": round(killed_at - t0, 1) if killed_at else None,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--minutes", type=float, default=90.0,
                   help="event time of traffic (default: 90: half an hour past a full window)")  # fmt: skip
    p.add_argument("--rate", type=float, default=50.0, help="requests/s of event time (default: 50)")
    p.add_argument("--items", type=int, default=200, help="items per request (default: 200)")
    p.add_argument("--label-after-s", type=float, default=5.0)
    p.add_argument("--attribution-s", type=float, default=3600.0)
    p.add_argument("--partitions", type=int, default=16)
    p.add_argument("--trainer", action="store_true",
                   help="the streaming trainer too, SIGKILLed seven tenths in: what it trained, counted")  # fmt: skip
    p.add_argument(
        "--store", help="with --trainer: an existing model store (default: train one into the work dir)"
    )
    keep_work_flag(p)
    args = parse(p, argv, {"minutes": 2.0, "rate": 20.0, "items": 20, "attribution_s": 60.0})
    result = run(args)
    print_table("bench-attribution", [result], [k for k in result if not isinstance(result[k], dict)])
    print("joiner RSS MB:", result["joiner_rss_mb"])
    report_targets(result, {
        "0 lost or made-up samples and clicks across the joiner's SIGKILL": not any(result[k] for k in (
            "lost_samples", "unexpected_samples", "lost_clicks", "clicks_labelled_twice", "unexpected_corrections")),
        "joiner RSS <= 600 MB": (result["joiner_rss_mb"]["max"] or 0) <= 600,
        **({"0 lost, 0 duplicated samples and corrections trained across the trainer's SIGKILL":
            not (result["trainer"]["lost_samples"] or result["trainer"]["duplicate_samples"])}
           if "trainer" in result else {}),
    })  # fmt: skip
    write_results("attribution", result, args.results_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
