"""The topics of ``make bench-stream`` and reading them as they fill: every impression and sample
from the start (``Collector``), reduced to the facts the figures need as each batch comes
(``impression_facts``, ``sample_facts``), and the partitions' watermarks."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from loadtest import stream_figures as sf
from stream.records import decode_impression
from stream.sample_batch import read_samples

TOPICS = {
    "impressions": 16,
    "events": 16,
    "samples": 16,
    "impressions.dead": 4,
    "events.dead": 4,
    "samples.dead": 4,
    "samples.quarantine": 4,
}
"""Topics and their partitions. The mock cluster keeps 5 MB a partition (librdkafka's
``rdkafka_mock.c``, not configurable): 16 partitions, and the joiner compresses its samples (lz4),
so that a few minutes of impressions and about two of samples stay readable by a joiner or a
trainer that lags (a killed joiner's successor starts at offsets committed before the kill)."""
JOINER_KAFKA = "compression.type=lz4\n"
"""The joiner's librdkafka settings (``--kafka-config``): lz4 samples (the mock cluster keeps 5 MB
a partition)."""
JOINER_MEMBER = "0/1"
"""The benches' joiner is a static member (``--member``): a SIGKILLed one's successor reads again at
once. As a group member it waited out the session timeout (6 s at the least) and a rebalance: 10-11
s after the kill here, with or without a static member id (``group.instance.id``)."""


LINGER_MS = 50
"""How long the producers of a bench at thousands of samples a second (the joiner's samples, the
users' clicks) wait to fill a batch (librdkafka's ``linger.ms``; 5 by default). Each batch is one
message set on the mock cluster, and it answers a fetch with one message set a partition ("FIXME:
Multiple messageSets ?"), found by walking the partition's sets one by one (``rdkafka_mock.c``,
``rd_kafka_mock_msgset_find``: "FIXME: Maintain an index"): at 10,000 samples/s in 5 ms batches
86% of the broker's CPU went there (perf), the broker used 50-75% of a core, the most of any
process, and a restarted joiner, one small batch a fetch, caught up at 11,000-13,000 samples/s."""
JOINER_KAFKA_BATCHED = JOINER_KAFKA + f"linger.ms={LINGER_MS}\n"
"""``JOINER_KAFKA`` with ``LINGER_MS``."""
USERS_LINGER_MS = 200
"""How long the simulated users' events producer waits to fill a batch in bench-soak (half an
hour). The mock cluster keeps a partition's message sets up to 5 MB, and every fetch walks them
from the oldest to find its offset (``rd_kafka_mock_msgset_find``, above). Clicks are about 100
bytes: in ``LINGER_MS`` batches (3-4 clicks a set at 1,100 clicks/s over 16 partitions) the
events partitions held 14,000 sets each by minute 15 of bench-soak, where perf found 93% of the
broker's CPU in that walk (the broker at 33-45% of a core from minute 10, rising as the partitions
filled), and a restarted joiner, which re-reads its events one set per partition a fetch, took 30
s to read its inputs to their ends (events back in a served delta 22.8 s after the kill). 200 ms
batches hold a quarter of the sets. The wait is part of event -> served, which is timed from the
click's hand-over to the producer."""


def joiner_role(
    brokers: str, window_s: float, group: str, work: Path, settings: str = JOINER_KAFKA
) -> list[str]:
    """``recserve join``'s arguments in a bench (its librdkafka ``settings`` written into ``work``)."""
    conf = work / "joiner-kafka.conf"
    conf.write_text(settings)
    return ["join", "--brokers", brokers, "--label-after-s", f"{window_s:g}", "--group", group,
            "--member", JOINER_MEMBER, "--kafka-config", str(conf)]  # fmt: skip


class Collector(threading.Thread):
    """Reads ``topic`` from its beginning for the whole run (the mock cluster keeps only a few MB a
    partition, so reading it at the end would miss the start), keeping ``decode(messages)`` of each
    batch read in ``parts``; ``finish`` reads on to the topic's end now, then stops. ``skipped``:
    the records the broker dropped before this read them (gaps in a partition's offsets), which a
    bench would otherwise count as never written. ``partitions``: the topic's (default: ``TOPICS``')."""

    def __init__(self, bootstrap: str, topic: str, decode, partitions: int | None = None) -> None:
        super().__init__(name=f"collect-{topic}", daemon=True)
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        self.topic, self.decode = topic, decode
        n = TOPICS[topic] if partitions is None else partitions
        self.parts: list = []
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-read-{topic}",
                                  "enable.auto.commit": False})  # fmt: skip
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(n)])
        self.next = [0] * n
        self.skipped = 0
        self.until: list[int] | None = None

    def run(self) -> None:
        while self.until is None or any(n < u for n, u in zip(self.next, self.until, strict=True)):
            msgs = [m for m in self.consumer.consume(10_000, timeout=0.5) if m.error() is None]
            if msgs:
                self.parts.append(self.decode(msgs))
            for m in msgs:
                partition, offset = m.partition() or 0, m.offset() or 0
                self.skipped += max(0, offset - self.next[partition])
                self.next[partition] = offset + 1
        self.consumer.close()

    def finish(self, watch, timeout_s: float = 120.0) -> list:
        self.until = high_watermarks(watch, self.topic)
        self.join(timeout_s)
        if self.is_alive():
            raise RuntimeError(
                f"{self.topic}: not read to its end {self.until} in {timeout_s:.0f} s: {self.next}"
            )
        return self.parts


def impression_facts(msgs: list) -> list[tuple[str, float, int, int]]:
    """(request id, ts, items, hash of the batch scored) of each impression."""
    out = []
    for m in msgs:
        imp = decode_impression(m.value() or b"")
        out.append((imp.request_id, imp.ts, len(imp.scores), hash(imp.batch)))
    return out


def sample_facts(msgs: list) -> sf.SampleLog:
    """The samples of one batch read (every record the joiner writes is valid)."""
    samples, bad = read_samples([m.value() or b"" for m in msgs])
    if bad:
        raise RuntimeError(f"samples topic: {len(bad)} records unreadable, e.g. {bad[0]}")
    part = np.fromiter((m.partition() for m in msgs), np.int64, len(msgs))
    offset = np.fromiter((m.offset() for m in msgs), np.int64, len(msgs))
    produced = np.fromiter((m.timestamp()[1] for m in msgs), np.float64, len(msgs)) / 1e3
    return sf.SampleLog(part[samples.index], offset[samples.index], samples.keys, samples.labels,
                        produced[samples.index])  # fmt: skip


def watermarks(consumer, topic: str) -> tuple[list[int], list[int]]:
    """Per partition, the first offset the broker still holds and the end."""
    from confluent_kafka import TopicPartition

    marks = [
        consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10) for p in range(TOPICS[topic])
    ]
    return [lo for lo, _ in marks], [hi for _, hi in marks]


def high_watermarks(consumer, topic: str) -> list[int]:
    return watermarks(consumer, topic)[1]
