"""Simulated users for learning from the stream: given impressions, they click.

    python -m loadtest.stream_users --brokers HOST:PORT [--ctr 0.05] [--score-weight 2] ...

reads the impressions topic (its own consumer group; ``--requests N`` writes N impressions there
first) and writes click events to the events topic,
keyed by request id, one ``{request_id, item, label: 1.0, ts}`` per click. The click model
(``UserModel``): an item is clicked with probability ``sigmoid(logit(ctr) + score_weight * (score
- mean score of its request))`` -- users like what the model ranks high, a little -- after a
delay (event time: the impression's ts plus the delay): exponential of mean ``delay_s``, or with
``fast_share`` < 1 heavy-tailed, that share of the clicks so and the rest log-normal of median
``tail_median_s`` (``make bench-delayed``: most clicks within seconds, a tail past the attribution
window); a click is sent to the events topic when it happens, not when its impression is read. With
``--drift-weight W`` the world drifts: each item's taste rises and falls with event time (period
``--drift-period-s``), so popular items fall out of fashion and others rise, and a model that keeps
learning has something to win (``make bench-stream``: W = 2, a period of 60 s: an item in fashion
is clicked e^4 ~ 55x as often as the same item half a minute later). With a ``reference`` (an
option of ``UserModel`` only) clicks follow the items instead of the served scores: item ``i`` is
clicked with probability ``sigmoid(logit(reference[i]) + taste)``, so a model that predicts the
reference is right whatever is served (``make bench-experiment``). Clicks of one request are
drawn at once (numpy), no loop per item.

``impressions(n, ...)`` makes impressions of a real ranking request (200 Criteo rows through the
shipped schema) for benches and the demo while the frontends do not log them yet.
"""

from __future__ import annotations

import argparse
import functools
import heapq
import itertools
import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from stream.records import (
    Event,
    Impression,
    Versions,
    decode_impression,
    encode_event,
    encode_impression,
)


@dataclass(frozen=True)
class UserModel:
    ctr: float = 0.05
    """Mean click probability of an item of average score."""
    score_weight: float = 2.0
    """How much more users click what the model scores high (logit per unit of score)."""
    delay_s: float = 5.0
    """Mean delay from impression to click (exponential) of the ``fast_share`` of clicks."""
    duplicate: float = 0.0
    """Share of clicks sent twice (clients retry)."""
    drift_weight: float = 0.0
    """A drifting world: each item (its position in the request) has a taste of its own that rises
    and falls, ``drift_weight * cos(2 pi (ts / drift_period_s + phase of the item))`` in logit; the
    items' phases are spread evenly over the period, so at any moment some items are in fashion and
    others out of it (0: no drift)."""
    drift_period_s: float = 120.0
    """Seconds (event time) for one item's taste to go round once."""
    invert: bool = False
    """A broken world (``make bench-guard``'s bad labels): users click what they would not, at
    the same rate (the logit of score and taste negated)."""
    reference: tuple[float, ...] | None = None
    """A world whose clicks follow the items, not the served scores (``make bench-experiment``):
    item ``i`` of a request (its position) is clicked with probability ``sigmoid(logit(reference[i])
    + taste)`` whatever it was scored; ``ctr`` and ``score_weight`` are then unused (None: the
    served-score model above)."""
    drift_origin_s: float | None = None
    """Event time at which every taste is zero (each taste is then its change since that time: the
    world is the reference's at the origin and drifts away from it); None: tastes as above."""
    clock_s: float = 0.0
    """Event time at which the tastes' clock starts (taken off every ts, and off
    ``drift_origin_s``): worlds started at other times with their own ``clock_s`` go the same way
    (``make bench-delayed``'s arms, one after another)."""
    fast_share: float = 1.0
    """Share of clicks whose delay is exponential of mean ``delay_s``; the rest come after a
    log-normal delay (``tail_median_s``, ``tail_sigma``): late feedback, a tail over a long
    horizon. 1 (the default): every click exponential, the draws of a world without a tail."""
    tail_median_s: float = 60.0
    """Median delay of the clicks outside ``fast_share`` (log-normal)."""
    tail_sigma: float = 1.5
    """Spread (sigma of the log) of the tail's delays: 1.5 puts 12% of them past 6x the median."""
    slate_ctr: float | None = None
    """With a ``reference``: the world's mean click rate, its items' click probabilities averaged
    over the request and over a drift period, set by adding one logit to every item (``shift``):
    a world whose clicks are rarer than the reference's scores (``make bench-delayed``: 0.03, a few
    clicks a slate of 200) ranks the items as they do. None: the reference as it is."""

    def __post_init__(self) -> None:
        if not 0 < self.ctr < 1 or self.delay_s < 0 or not 0 <= self.duplicate <= 1:
            raise ValueError(f"need 0 < ctr < 1, delay_s >= 0, 0 <= duplicate <= 1: {self}")
        if not 0 <= self.fast_share <= 1 or self.tail_median_s <= 0 or self.tail_sigma < 0:
            raise ValueError(f"need 0 <= fast_share <= 1, tail_median_s > 0, tail_sigma >= 0: {self}")
        if self.drift_weight < 0 or self.drift_period_s <= 0:
            raise ValueError(f"need drift_weight >= 0 and drift_period_s > 0: {self}")
        if self.reference is not None and not all(0 < p < 1 for p in self.reference):
            raise ValueError("need every reference click probability in (0, 1)")
        if self.slate_ctr is not None and (self.reference is None or not 0 < self.slate_ctr < 1):
            raise ValueError(f"slate_ctr needs a reference and 0 < slate_ctr < 1: {self}")

    @functools.cached_property
    def shift(self) -> float:
        """The logit added to every item of a reference world so that its mean click rate is
        ``slate_ctr`` (0 without one): bisection, the mean rising with the shift."""
        if self.slate_ctr is None or self.reference is None:
            return 0.0
        ref = np.asarray(self.reference, np.float64)
        ts = self.clock_s + self.drift_period_s * np.arange(64)[:, None] / 64  # one drift period
        logit = np.log(ref) - np.log1p(-ref) + self.taste(len(ref), ts)
        lo, hi = -30.0, 30.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if np.mean(1 / (1 + np.exp(-(logit + mid)))) < self.slate_ctr else (lo, mid)
        return (lo + hi) / 2

    def taste(self, n_items: int, ts: float | np.ndarray) -> np.ndarray:
        """Each of ``n_items`` items' drifting taste (logit) at event time ``ts`` (a column of times:
        a row each); zeros without drift. The items' phases are golden-ratio spaced, so neighbours in
        a request drift apart."""
        if not self.drift_weight:
            return np.zeros(n_items)
        phase = np.arange(n_items) * 0.6180339887498949 % 1.0
        taste = self.drift_weight * np.cos(2 * np.pi * ((ts - self.clock_s) / self.drift_period_s + phase))
        if self.drift_origin_s is not None:
            origin = (self.drift_origin_s - self.clock_s) / self.drift_period_s
            taste -= self.drift_weight * np.cos(2 * np.pi * (origin + phase))
        return taste

    def click_probability(self, scores: np.ndarray, ts: float | np.ndarray) -> np.ndarray:
        """Each item's click probability in a request scored ``scores`` at event time ``ts`` (with
        a reference, a column of times: a row each): a base logit plus the items' liking (negated
        when ``invert``)."""
        scores = np.asarray(scores, np.float64)
        taste = self.taste(len(scores), ts)
        if self.reference is None:
            base = math.log(self.ctr / (1 - self.ctr))
            liking = self.score_weight * (scores - scores.mean()) + taste
        else:
            if len(self.reference) != len(scores):
                raise ValueError(f"a request of {len(scores)} items, a reference of {len(self.reference)}")
            ref = np.log(np.asarray(self.reference)) - np.log1p(-np.asarray(self.reference))
            base, liking = float(ref.mean()) + self.shift, ref - ref.mean() + taste
        logit = base + (-liking if self.invert else liking)
        return 1 / (1 + np.exp(-logit))

    def delays(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` clicks' delays (seconds): exponential of mean ``delay_s`` (0: none), then with
        ``fast_share`` < 1 each one outside that share replaced by a log-normal one (a world
        without a tail draws nothing more, so its draws are those it always made)."""
        fast = rng.exponential(self.delay_s, n) if self.delay_s else np.zeros(n)
        if self.fast_share >= 1:
            return fast
        tail = rng.random(n) >= self.fast_share
        return np.where(tail, rng.lognormal(math.log(self.tail_median_s), self.tail_sigma, n), fast)

    def clicks(self, imp: Impression, rng: np.random.Generator) -> list[Event]:
        p_click = self.click_probability(np.asarray(imp.scores), imp.ts)
        items = np.flatnonzero(rng.random(len(p_click)) < p_click)
        ts = imp.ts + self.delays(len(items), rng)
        again = rng.random(len(items)) < self.duplicate
        items, ts = np.concatenate([items, items[again]]), np.concatenate([ts, ts[again]])
        return [Event(imp.request_id, i, 1.0, t) for i, t in zip(items.tolist(), ts.tolist(), strict=True)]


def ranking_batch_bytes(rows: int = 200) -> bytes:
    """A ranking request of ``rows`` Criteo rows through the shipped schema, encoded."""
    from features import stream
    from features.codec import encode
    from features.readers import to_records
    from features.schema import load_schema
    from features.transform import transform
    from loadtest.common import ROOT

    schema = load_schema(ROOT / "data/schemas/criteo.yaml")
    table = stream.read(str(ROOT / "data/criteo/wide_resdnn_criteo_test.tsv"), schema, limit=rows)
    return encode(transform(to_records(table, schema), schema))


def impressions(
    n: int, start_ts: float, every_s: float, batch: bytes, rows: int, seed: int = 0
) -> list[Impression]:
    """``n`` impressions of one batch, ``every_s`` apart from ``start_ts``, random scores."""
    rng = np.random.default_rng(seed)
    scores = rng.random((n, rows), dtype=np.float32)
    return [Impression(f"req-{seed}-{i}", start_ts + i * every_s, Versions("v1", 0, "v1"), scores[i], batch)
            for i in range(n)]  # fmt: skip


def produce(bootstrap: str, topic: str, records: list[tuple[str, bytes]], settings: dict | None = None,
            partition: int = -1) -> None:  # fmt: skip
    """(key, value) records to ``topic`` (to ``partition``, else by key), all acknowledged (or a
    RuntimeError)."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "queue.buffering.max.messages": 1_000_000,
                  "enable.idempotence": True, **(settings or {})})  # fmt: skip
    failed: list[str] = []

    def done(err, _msg) -> None:
        if err is not None:
            failed.append(err.str())

    for key, value in records:
        while True:
            try:
                p.produce(topic, value, key.encode(), partition=partition, on_delivery=done)
                break
            except BufferError:
                p.poll(0.05)
    if p.flush(60) or failed:
        raise RuntimeError(f"{topic}: {len(failed)} records not delivered: {failed[:3]}")


TURN_S = 0.01
"""``play``'s shortest turn: the clicks due within it are sent together. A turn per click (3,000
clicks a second at 60 requests/s of 200 items) kept the users' thread turning 3,000 times a second,
a consume, a produce and a poll each, in the process that measures the loop."""


def play(bootstrap: str, model: UserModel, stop: threading.Event, impressions_topic: str = "impressions",
         events_topic: str = "events", group: str = "stream-users", seed: int = 0,
         on_sent: Callable[[list[Event], float], None] | None = None,
         world: Callable[[], UserModel] | None = None,
         gate: Callable[[list[Event]], list[Event]] | None = None,
         on_drawn: Callable[[Impression, list[Event]], None] | None = None, linger_ms: float = 5.0) -> int:  # fmt: skip
    """Click on every impression read until ``stop``; returns how many events were sent. A click
    is sent when it happens (its ``ts``, the impression's time plus the user's delay; within ``TURN_S``), as a user's
    browser would, not when the impression is read; ``on_sent(events, t)`` is told each batch sent
    and the wall time it was handed to the producer. ``world()``: the user model of the moment
    (default ``model``); ``gate(due)``: what of the clicks due is sent now (a broken pipeline holds
    or drops them, and may hand held ones back later), called at every turn; ``on_drawn(imp,
    clicks)``: each impression read and the clicks drawn for it, sent or not yet (the world's
    final labels); ``linger_ms``: the events producer's (``stream_topics.LINGER_MS`` for
    thousands of items a second). The process that plays them (a bench's own) is frozen first
    (``serving.memory.freeze_loaded``): a full collection of its imports held it 0.24-0.30 s every
    10 s, and the clicks with it."""
    from confluent_kafka import Consumer, Producer

    from serving import memory

    memory.freeze_loaded()
    rng = np.random.default_rng(seed)
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest"})
    c.subscribe([impressions_topic])
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": linger_ms, "enable.idempotence": True})
    due: list[tuple[float, int, Event]] = []  # heap of clicks not sent yet, by ts (then arrival)
    order = itertools.count()  # ties in ts go in arrival order
    failed: list[str] = []
    sent = 0

    def done(err, _msg) -> None:
        if err is not None:
            failed.append(err.str())

    try:
        while not stop.is_set():
            wait = min(0.05, max(TURN_S, due[0][0] - time.time())) if due else 0.05
            for m in c.consume(1000, timeout=wait):
                if m.error() is None:
                    imp = decode_impression(m.value() or b"")
                    drawn = (world() if world else model).clicks(imp, rng)
                    if on_drawn is not None:
                        on_drawn(imp, drawn)
                    for e in drawn:
                        heapq.heappush(due, (e.ts, next(order), e))
            now = time.time()
            batch = []
            while due and due[0][0] <= now:
                batch.append(heapq.heappop(due)[2])
            if gate is not None:
                batch = gate(batch)
            for e in batch:
                p.produce(events_topic, encode_event(e), e.request_id.encode(), on_delivery=done)
            p.poll(0)
            if batch and on_sent is not None:
                on_sent(batch, now)
            sent += len(batch)
            if failed:
                raise RuntimeError(f"{events_topic}: {len(failed)} events not delivered: {failed[:3]}")
    finally:
        c.close()
        p.flush(30)
    return sent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.stream_users", description=__doc__.split("\n\n")[0])
    p.add_argument("--brokers", required=True, help="Kafka bootstrap servers")
    p.add_argument("--impressions", default="impressions", help="impressions topic (default: impressions)")
    p.add_argument("--events", default="events", help="events topic (default: events)")
    p.add_argument(
        "--ctr", type=float, default=0.05, help="click probability of an average item (default: 0.05)"
    )
    p.add_argument("--score-weight", type=float, default=2.0, help="logit per unit of score (default: 2)")
    p.add_argument("--delay-s", type=float, default=5.0, help="mean click delay in seconds (default: 5)")
    p.add_argument("--fast-share", type=float, default=1.0,
                   help="share of clicks after an exponential delay of mean --delay-s; the rest log-normal "
                        "(default: 1, no tail)")  # fmt: skip
    p.add_argument("--tail-median-s", type=float, default=60.0, help="median delay of the tail (default: 60)")
    p.add_argument(
        "--tail-sigma", type=float, default=1.5, help="sigma of the tail's log delay (default: 1.5)"
    )
    p.add_argument(
        "--drift-weight",
        type=float,
        default=0.0,
        help="a drifting world: logit amplitude of each item's rising and falling taste (default: 0)",
    )
    p.add_argument("--drift-period-s", type=float, default=120.0,
                   help="seconds for an item's taste to go round once (default: 120)")  # fmt: skip
    p.add_argument("--requests", type=int, default=0,
                   help="first write this many impressions of 200 Criteo items, scored now (the demo's "
                        "stand-in for the frontends' impression log)")  # fmt: skip
    args = p.parse_args(argv)
    if args.requests:
        imps = impressions(args.requests, time.time(), 0.0, ranking_batch_bytes(200), 200)
        produce(args.brokers, args.impressions, [(i.request_id, encode_impression(i)) for i in imps])
        print(f"stream_users: {len(imps)} impressions written", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    model = UserModel(args.ctr, args.score_weight, args.delay_s, fast_share=args.fast_share,
                      tail_median_s=args.tail_median_s, tail_sigma=args.tail_sigma, drift_weight=args.drift_weight,
                      drift_period_s=args.drift_period_s)  # fmt: skip
    sent = play(args.brokers, model, stop, args.impressions, args.events)
    print(f"stream_users: {sent} events sent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
