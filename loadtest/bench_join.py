"""``make bench-join``: how fast ``recserve join`` replays a topic (samples/s), on the mock broker.

    python -m loadtest.bench_join [--requests 1000] [--partitions 32] [--quick] [--results-dir DIR]

Fills impressions (``--requests`` requests of 200 Criteo items, 40 ms apart in event time) and
the click events of simulated users (``loadtest.stream_users``) into 4-partition topics, then
times one joiner (the product's ``Joiner``, in this process) from its first record (after the
consumer group's first rebalance) until every sample is acknowledged by the broker: ``samples_per_s``
against the target (a saturated frontend's output, issue 57), and the CPU seconds the joiner's
thread used per sample (what other processes on the machine take from it does not count there).
Writes loadtest/results/join.json.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import numpy as np

from loadtest import mockbroker
from loadtest.common import parse, parser, report_targets, write_results
from loadtest.stream_users import UserModel, impressions, produce, ranking_batch_bytes
from stream.config import JoinConfig
from stream.joiner import Joiner
from stream.records import Event, encode_event, encode_impression

ROWS = 200
TARGET = 60_000


def fill(broker: mockbroker.Broker, requests: int, partitions: int, seed: int = 0) -> tuple[int, int]:
    """Topics filled; returns (samples expected, events)."""
    for name in ("impressions", "events", "samples", "impressions.dead", "events.dead", "samples.quarantine"):
        broker.create_topic(name, partitions)
    imps = impressions(requests, 1.7e9, 0.04, ranking_batch_bytes(ROWS), ROWS, seed)
    rng = np.random.default_rng(seed)
    events = [e for imp in imps for e in UserModel(delay_s=2.0).clicks(imp, rng)]
    produce(broker.bootstrap, "impressions", [(i.request_id, encode_impression(i)) for i in imps])
    produce(broker.bootstrap, "events", [(e.request_id, encode_event(e)) for e in events])
    # per partition, one impression and its click long after the rest: the event time they carry
    # closes every window of the replay, so the replay's tail does not wait on the wall clock
    tick = impressions(1, imps[-1].ts + 1000, 0, ranking_batch_bytes(ROWS), ROWS, seed + 1)[0]
    for p in range(partitions):
        tick_p = dataclasses.replace(tick, request_id=f"tick-{p}")
        produce(
            broker.bootstrap, "impressions", [(tick_p.request_id, encode_impression(tick_p))], partition=p
        )
        click = Event(tick_p.request_id, 0, 1.0, tick_p.ts)
        produce(broker.bootstrap, "events", [(click.request_id, encode_event(click))], partition=p)
    return requests * ROWS + partitions, len(events)


def replay(bootstrap: str, expected: int, window_s: float, timeout_s: float = 600) -> dict:
    joiner = Joiner(JoinConfig(brokers=bootstrap, label_after_s=window_s, group="bench-join"))
    joiner.check_topics()
    stop, cpu_s = threading.Event(), [0.0]

    def run() -> None:
        start = time.thread_time()
        try:
            joiner.run(stop)
        finally:
            cpu_s[0] = time.thread_time() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    c = joiner.counts
    while c.impressions == 0 and thread.is_alive():  # the consumer group's first rebalance is not timed
        time.sleep(0.01)
    t0 = time.perf_counter()
    while c.acked < expected and time.perf_counter() - t0 < timeout_s and thread.is_alive():
        time.sleep(0.05)
    elapsed = time.perf_counter() - t0
    stop.set()
    thread.join(60)
    samples = c.positives + c.negatives
    return {"samples": samples, "positives": c.positives, "late_events": c.late, "duplicates": c.duplicates,
            "seconds": round(elapsed, 2), "samples_per_s": round(samples / elapsed),
            "joiner_cpu_us_per_sample": round(1e6 * cpu_s[0] / max(samples, 1), 2)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--requests", type=int, default=1000, help="impressions of 200 items (default: 1000)")
    p.add_argument("--partitions", type=int, default=32,
                   help="partitions per topic (default: 32; the mock keeps about 5 MB a partition)")  # fmt: skip
    p.add_argument("--window-s", type=float, default=10.0, help="join window, event time (default: 10)")
    args = parse(p, argv, {"requests": 20, "partitions": 4})
    with mockbroker.running() as broker:
        expected, events = fill(broker, args.requests, args.partitions)
        load_before = os.getloadavg()
        result = replay(broker.bootstrap, expected, args.window_s)
    result.update(requests=args.requests, items=ROWS, events=events, partitions=args.partitions,
                  target_samples_per_s=TARGET,
                  machine={"loadavg_before": [round(x, 2) for x in load_before],
                           "loadavg_after": [round(x, 2) for x in os.getloadavg()],
                           "note": "the mock cluster (a process of its own) and the joiner share this machine"})  # fmt: skip
    print(result)
    report_targets(result, {f"one joiner process >= {TARGET:,} samples/s": result["samples_per_s"] >= TARGET})
    write_results("join", result, args.results_dir)
    return 0 if result["samples"] >= expected else 1


if __name__ == "__main__":
    raise SystemExit(main())
