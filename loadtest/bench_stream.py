"""``make bench-stream``: learning from the stream, end to end, with a trainer and a joiner killed.

    python -m loadtest.bench_stream [--minutes 5] [--rate 25] [--quick] [--results-dir DIR] [--store DIR]

On the mock Kafka cluster (``serving.stream.mockbroker``, a process of its own): ``recserve serve``
+ co-located lookups with ``--log-impressions``, loaded at ``--rate`` requests/s of one request of
200 items (the same 200 items every time, so an item's taste can be learnt); simulated users
(``loadtest.stream_users``) clicking in a drifting world (each item's taste rises and falls with
``--drift-period-s``); ``recserve join``; the streaming trainer ``recserve train --follow --stream``
publishing deltas into the served version. A third of the way in the trainer is SIGKILLed and
restarted, two thirds in the joiner. Then the load stops, the joiner and the trainers catch up, and
everything is counted against the impression log: every impression whose join window closed
before the end (``window_s`` before the last impression) must be trained exactly once --
``lost_samples`` (never trained) and ``duplicate_samples`` (trained twice: the deltas' sample
counts over the distinct keys their trained-key files hold). The impressions and samples topics are
read as they fill, from the start (the mock cluster keeps only a few MB a partition).

``progressive_auc``: each sample scored before it trains (the trainer's progressive validation),
the deltas' AUCs weighted by their samples; ``frozen`` is a second trainer on a copy of the
version served at the start, at a learning rate of 1e-12 (the lowest --lr takes: the served version,
frozen), over the same samples topic to its end. ``max_lag_samples``: the most samples the
streaming trainer's published offsets were behind the samples topic's end, sampled every second.
Writes ``loadtest/results/stream.json``.

``--quick``: 0.4 minutes at 4 rps (checks the bench, its figures mean little).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

import model_store as ms
from loadtest.bench_e2e import lean_frontend, request_bodies
from loadtest.common import given_or_trained, parse, parser, report_targets, write_results
from loadtest.processes import Sampler
from loadtest.stream_users import UserModel, play
from model_store.deltas import DeltaManifest, read_delta, read_keys
from model_store.dense import AUTO
from serving.rpc.procs import spawn, stop_children
from serving.stream import mockbroker
from serving.stream.records import decode_impression, decode_sample

PARTITIONS = 4
TOPICS = ("impressions", "events", "samples", "samples.dead", "join-dead-letter")
FROZEN_LR = 1e-12


class Collector(threading.Thread):
    """Reads ``topic`` from its beginning for the whole run (the mock cluster keeps only a few MB a
    partition, so reading it at the end would miss the start), keeping ``decode(value)`` of each
    record in ``items`` (with ``stamped``, ``(decode(value), its produce time)``, time.time()'s
    scale); ``finish`` reads on to the topic's end now, then stops."""

    def __init__(self, bootstrap: str, topic: str, decode, stamped: bool = False) -> None:
        super().__init__(name=f"collect-{topic}", daemon=True)
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        self.topic, self.decode, self.stamped = topic, decode, stamped
        self.items: list = []
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-read-{topic}",
                                  "enable.auto.commit": False})  # fmt: skip
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
        self.next = [0] * PARTITIONS
        self.until: list[int] | None = None

    def run(self) -> None:
        while self.until is None or any(n < u for n, u in zip(self.next, self.until, strict=True)):
            for m in self.consumer.consume(10_000, timeout=0.5):
                if m.error() is None:
                    item = self.decode(m.value() or b"")
                    self.items.append((item, (m.timestamp()[1] or 0) / 1e3) if self.stamped else item)
                    self.next[m.partition() or 0] = (m.offset() or 0) + 1
        self.consumer.close()

    def finish(self, watch, timeout_s: float = 120.0) -> list:
        self.until = high_watermarks(watch, self.topic)
        self.join(timeout_s)
        if self.is_alive():
            raise RuntimeError(
                f"{self.topic}: not read to its end {self.until} in {timeout_s:.0f} s: {self.next}"
            )
        return self.items


def high_watermarks(consumer, topic: str) -> list[int]:
    from confluent_kafka import TopicPartition

    return [
        consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(PARTITIONS)
    ]


def deltas(model_dir: Path) -> list[tuple[Path, DeltaManifest]]:
    """(directory, DELTA.json record) of every published delta of the model's current version."""
    version = ms.current(model_dir.parent, model_dir.name)
    if version is None:
        raise RuntimeError(f"{model_dir}: no current version")
    vdir = ms.version_dir(model_dir.parent, model_dir.name, version)
    out = []
    for seq in ms.list_deltas(vdir):
        d = ms.delta_dir(vdir, seq)
        if (record := read_delta(d)) is not None:
            out.append((d, record))
    return out


def trained(model_dir: Path) -> tuple[int, int, set[bytes], float | None, int]:
    """(samples trained over all deltas, distinct keys counted twice or more, the distinct trained
    keys, the samples-weighted progressive AUC, the offsets trained up to)."""
    published = deltas(model_dir)
    if not published:
        return 0, 0, set(), None, 0
    samples = sum(r.samples for _, r in published)
    d, last = published[-1]
    keys = read_keys(d, last)[0].tolist()
    scored = [(r.auc, r.samples) for _, r in published if r.auc is not None and r.samples]
    auc = float(np.average([a for a, _ in scored], weights=[n for _, n in scored])) if scored else None
    return samples, len(keys) - len(set(keys)), set(keys), auc, sum(last.positions.values())


def sample_key(request_id: str, item: int) -> bytes:
    """A trained key as ``serving.stream.sample_batch`` writes it: the item (4 bytes, big-endian),
    then the request id."""
    return item.to_bytes(4, "big") + request_id.encode()


def load(endpoint: str, body: bytes, rate: float, stop: threading.Event, threads: int = 4) -> list[int]:
    """Post ``body`` at ``rate`` requests/s (``threads`` clients, each on its own schedule) until
    ``stop``; returns [ok, failed]."""
    from serving.scoring.client import ScoringClient

    counts = [0, 0]
    lock = threading.Lock()

    def client(i: int) -> None:
        c = ScoringClient(endpoint, None)
        every = threads / rate
        t = time.monotonic() + i * every / threads
        try:
            while not stop.is_set():
                if (wait := t - time.monotonic()) > 0 and stop.wait(wait):
                    return
                status, _ = c.post(body)
                with lock:
                    counts[status != 200] += 1
                t += every
        finally:
            c.close()

    workers = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    stop.wait()
    for w in workers:
        w.join(30)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--store", help="existing model store (default: train one into a temp dir)")
    p.add_argument("--model", default="criteo")
    p.add_argument("--minutes", type=float, default=5.0, help="minutes of load (default: 5)")
    p.add_argument("--rate", type=float, default=25.0, help="requests/s of 200 items (default: 25)")
    p.add_argument("--window-s", type=float, default=10.0, help="the joiner's window (default: 10)")
    p.add_argument("--drift-period-s", type=float, default=120.0, help="(default: 120)")
    p.add_argument("--drift-weight", type=float, default=2.0, help="(default: 2)")
    p.add_argument("--catch-up-s", type=float, default=180.0, help="most seconds to catch up at the end")
    args = parse(p, argv, {"minutes": 0.4, "rate": 4.0, "window_s": 4.0, "drift_period_s": 12.0,
                           "catch_up_s": 90.0})  # fmt: skip
    duration = args.minutes * 60
    work = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    try:
        store = given_or_trained(args.store, work)
        served = work / "served"
        shutil.copytree(store, served)
        frozen = work / "frozen"
        shutil.copytree(store, frozen)
        out = run(args, served / args.model, frozen / args.model, work, duration)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ok = {"no_duplicates": out["duplicate_samples"] == 0, "no_lost": out["lost_samples"] == 0}
    auc = out["progressive_auc"]
    if auc["streaming"] is not None and auc["frozen"] is not None:
        ok["streaming_auc_ge_frozen_plus_0.02"] = auc["streaming"] >= auc["frozen"] + 0.02
    report_targets(out, ok)
    print({k: v for k, v in out.items() if k != "conditions"})
    path = write_results("stream", out, args.results_dir)
    print(f"wrote {path}")
    return 0


def run(args, model_dir: Path, frozen_dir: Path, work: Path, duration: float) -> dict:
    from confluent_kafka import Consumer

    body = request_bodies()[0]
    with contextlib.ExitStack() as es:
        broker = es.enter_context(mockbroker.running([mockbroker.TopicSpec(t, PARTITIONS) for t in TOPICS]))
        b = broker.bootstrap
        stream = f"kafka://{b}/samples"
        endpoint, _ = es.enter_context(
            lean_frontend(
                model_dir.parent,
                args.model,
                "colocated",
                None,
                work,
                AUTO,
                1.0,
                ("--log-impressions", f"kafka://{b}/impressions"),
            )  # fmt: skip
        )
        roles = {
            "joiner": ["join", "--brokers", b, "--window-s", f"{args.window_s:g}", "--group", "bench-stream"],
            "trainer": ["train", "--follow", str(model_dir), "--stream", stream, "--delta-interval-s", "2"],
            "frozen": ["train", "--follow", str(frozen_dir), "--stream", stream, "--delta-interval-s", "2",
                       "--lr", f"{FROZEN_LR:g}"],
        }  # fmt: skip
        procs = {name: spawn(argv, work / f"{name}.log") for name, argv in roles.items()}
        es.callback(lambda: stop_children([p for p in procs.values() if p.poll() is None]))
        model = UserModel(delay_s=2.0, drift_weight=args.drift_weight, drift_period_s=args.drift_period_s)
        stop_users, stop_load = threading.Event(), threading.Event()
        users = threading.Thread(target=play, args=(b, model, stop_users), daemon=True)
        users.start()
        collectors = {"impressions": Collector(b, "impressions", decode_impression),
                      "samples": Collector(b, "samples", lambda v: decode_sample(v).key)}  # fmt: skip
        for c in collectors.values():
            c.start()
        loaded: list[int] = []
        loader = threading.Thread(target=lambda: loaded.extend(load(endpoint, body, args.rate, stop_load)))
        lags: list[int] = []
        watch = Consumer({"bootstrap.servers": b, "group.id": "bench-watch"})
        print(f"load {args.rate:g} rps for {duration:.0f} s; trainer killed at {duration / 3:.0f} s, "
              f"joiner at {2 * duration / 3:.0f} s", flush=True)  # fmt: skip
        with Sampler(lambda: [p.pid for p in procs.values() if p.poll() is None], 1.0) as sampler:
            t0 = time.monotonic()
            loader.start()
            for at, name in ((duration / 3, "trainer"), (2 * duration / 3, "joiner"), (duration, "")):
                while (left := t0 + at - time.monotonic()) > 0:
                    time.sleep(min(1.0, left))
                    lags.append(sum(high_watermarks(watch, "samples")) - trained(model_dir)[4])
                if name:
                    os.killpg(procs[name].pid, signal.SIGKILL)
                    procs[name].wait()
                    print(f"  {time.monotonic() - t0:.0f} s: {name} SIGKILLed, restarted", flush=True)
                    procs[name] = spawn(roles[name], work / f"{name}.log")
            stop_load.set()
            loader.join(60)
            load_s = time.monotonic() - t0
            imps = collectors["impressions"].finish(watch)
            last_ts = max(i.ts for i in imps)
            closed = [i for i in imps if i.ts + args.window_s < last_ts]
            expected = {sample_key(i.request_id, item) for i in closed for item in range(len(i.scores))}
            deadline = time.monotonic() + args.catch_up_s
            while time.monotonic() < deadline:  # the joiner, then both trainers, to the topic's end
                end = sum(high_watermarks(watch, "samples"))
                if trained(model_dir)[4] >= end and trained(frozen_dir)[4] >= end and \
                        expected <= trained(model_dir)[2]:  # fmt: skip
                    break
                time.sleep(1.0)
            catch_up_s = time.monotonic() - t0 - load_s
            stop_users.set()
            stop_children([procs["trainer"], procs["frozen"]], 60)  # SIGTERM: a last delta each
        samples = collectors["samples"].finish(watch)
        watch.close()
    n_trained, dup_keys, keys, auc, _ = trained(model_dir)
    frozen_auc = trained(frozen_dir)[3]
    joined = {sample_key(*k) for k in samples}
    return {
        "impressions": len(imps),
        "requests": {"ok": loaded[0] if loaded else 0, "failed": loaded[1] if loaded else 0},
        "samples_joined": len(joined),
        "samples_produced": len(samples),
        "samples_trained": n_trained,
        "duplicate_samples": n_trained - len(keys) + dup_keys,
        "lost_samples": len(expected - keys),
        "samples_expected": len(expected),
        "progressive_auc": {
            "streaming": round(auc, 4) if auc is not None else None,
            "frozen": round(frozen_auc, 4) if frozen_auc is not None else None,
        },  # fmt: skip
        "join_samples_per_s": round(len(joined) / (load_s + catch_up_s)),
        "train_samples_per_s": round(n_trained / (load_s + catch_up_s)),
        "max_lag_samples": max(lags, default=0),
        "lag_samples": lags,
        "catch_up_s": round(catch_up_s, 1),
        "peak_rss_bytes": sampler.peak_rss(),
        "conditions": {
            "frontend": "recserve serve, co-located lookups, --log-impressions",
            "rate_rps": args.rate,
            "request_items": 200,
            "load_s": round(load_s, 1),
            "window_s": args.window_s,
            "click_delay_s": 2.0,
            "drift_weight": args.drift_weight,
            "drift_period_s": args.drift_period_s,
            "partitions": PARTITIONS,
            "kills": "trainer SIGKILL at 1/3, joiner at 2/3, each restarted at once",
            "frozen": f"the start's version trained at lr {FROZEN_LR:g} on the same topic",
            "auc": "progressive, per delta, weighted by samples",
            "broker": "librdkafka mock cluster, 3 brokers, one process; everything on this machine",
        },  # fmt: skip
    }


if __name__ == "__main__":
    raise SystemExit(main())
