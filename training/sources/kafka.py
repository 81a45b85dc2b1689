"""A Kafka topic of samples (``recserve join``'s), unbounded: ``kafka://BROKERS/TOPIC``, e.g.
``kafka://localhost:9092,host2:9092/samples``.

Its parts are the topic's partitions (``list_parts``: ``Part(<topic>/<partition>, partition)``);
this rank's share (``share``: partition % world == rank) is assigned at each part's resume
position, the offset the ledger says (0 or unknown: the earliest kept), with no consumer-group commits: where the
trainer stands is what the last published delta recorded (``model_store.deltas``), so a restarted
trainer reads on from exactly there. A chunk (a ``KeyedChunk``) is one partition's records of one batch consume
(``Reading.batch_rows`` at most); its unit is ``<topic>/<partition>``, its start the first
record's offset and its ``end`` the offset after the last; the chunks of one consume lie between
two ``TICK``s (the trainer steps on them together). ``behind()`` is the consumer lag: records of
the rank's partitions not yielded yet. Records are decoded together
(``stream.sample_batch``: no loop per record beyond the accessors confluent-kafka
forces). A malformed record, or one that does not fit the followed schema, goes to the
dead-letter topic ``<TOPIC>.dead`` as it was, with headers saying why and where
(``stream.dead_letter``), counted in the chunk's ``refused``; the trainer goes on.

Reading with ``once``: end when every partition is read up to its end as it was at the start.
librdkafka settings come from ``RECSERVE_KAFKA_*`` variables (``RECSERVE_KAFKA_SECURITY_PROTOCOL=
SASL_SSL`` sets ``security.protocol``): SASL/TLS for real brokers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stream import dead_letter
from stream.config import FETCH_WAIT_MS
from stream.sample_batch import read_fitting, take
from training.sources.ledger import Ledger
from training.sources.registry import SourceKind, register
from training.sources.types import TICK, Keyed, KeyedChunk, Part, Position, Reading, TableChunk, share

log = logging.getLogger("recserve.train.follow")

TIMEOUT_S = 10.0  # metadata, watermarks and dead-letter acknowledgements


def settings(brokers: str) -> dict[str, str]:
    """librdkafka's settings: the brokers, then every ``RECSERVE_KAFKA_<NAME>`` variable as
    ``<name>`` (lower case, '_' -> '.')."""
    out = {"bootstrap.servers": brokers}
    for k, v in os.environ.items():
        if k.startswith("RECSERVE_KAFKA_"):
            out[k.removeprefix("RECSERVE_KAFKA_").lower().replace("_", ".")] = v
    return out


def parse(where: str) -> tuple[str, str]:
    """(brokers, topic) of ``BROKERS/TOPIC``; a ValueError naming the form otherwise."""
    brokers, sep, topic = where.rpartition("/")
    if not sep or not brokers or not topic:
        raise ValueError(f"kafka://{where}: expected kafka://BROKERS/TOPIC (host:port[,host:port...]/topic)")
    return brokers, topic


@dataclass
class KafkaSamples:
    brokers: str
    topic: str
    reading: Reading
    ledger: Ledger
    bounded = False
    _consumer: Any = field(default=None, init=False)  # while ``chunks`` runs
    _at: dict[Part, int] = field(default_factory=dict, init=False)  # part -> next offset yielded
    _ends: dict[Part, int] = field(default_factory=dict, init=False)  # part -> end offset seen
    _parts: list[Part] | None = field(default=None, init=False)  # the topic's, once listed

    @property
    def dead_topic(self) -> str:
        return dead_letter.topic_of(self.topic)

    def part(self, partition: int) -> Part:
        return Part(f"{self.topic}/{partition}", partition)

    def list_parts(self) -> list[Part]:
        """The topic's partitions, in number order (asked of the brokers once)."""
        if self._parts is None:
            consumer = self._open_consumer()
            try:
                self._list(consumer)
            finally:
                consumer.close()
        assert self._parts is not None
        return self._parts

    def _open_consumer(self) -> Any:
        from confluent_kafka import Consumer

        return Consumer({"fetch.wait.max.ms": FETCH_WAIT_MS} | settings(self.brokers) | {"group.id": f"recserve-train-{self.topic}", "enable.auto.commit": False,
                         "auto.offset.reset": "earliest", "enable.partition.eof": False})  # fmt: skip

    def chunks(self) -> Iterator[KeyedChunk | TableChunk]:
        from confluent_kafka import Producer

        conf = settings(self.brokers)
        consumer = self._open_consumer()
        producer = Producer(conf | {"acks": "all", "enable.idempotence": True})
        try:
            ends = self._assign(consumer)
            self._at = {p: p.resume(self.ledger).row for p in ends}
            self._ends, self._consumer = dict(ends), consumer
            while True:
                yield TICK
                if self.reading.once and all(self._at[p] >= ends[p] for p in ends):
                    return
                wait = self.reading.poll_s if self.reading.fill_s is None else self.reading.fill_s
                msgs = consumer.consume(num_messages=self.reading.batch_rows, timeout=wait)
                for part, chunk in self._chunks(msgs, producer):
                    self._at[part] = chunk.end
                    yield chunk
        finally:
            self._consumer = None
            consumer.close()
            left = producer.flush(TIMEOUT_S)
            if left:
                log.error("%d dead letters to %s not acknowledged at exit", left, self.dead_topic)

    def behind(self) -> int | None:
        """Records of this rank's partitions after those yielded: each partition's end offset as
        the consumer last saw it (librdkafka's cached high watermark, updated by every fetch: no
        request) less where it stands; None before the partitions are assigned."""
        from confluent_kafka import TopicPartition

        if self._consumer is None:
            return None
        behind = 0
        for p, at in self._at.items():
            hi = self._consumer.get_watermark_offsets(TopicPartition(self.topic, p.index), cached=True)[1]
            self._ends[p] = max(self._ends[p], hi)  # no fetch yet: the end found at the start
            behind += max(0, self._ends[p] - at)
        return behind

    def _list(self, consumer) -> list[Part]:
        """The topic's partitions, as the brokers say now (kept for ``list_parts``)."""
        meta = consumer.list_topics(self.topic, timeout=TIMEOUT_S).topics.get(self.topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise ValueError(f"kafka://{self.brokers}/{self.topic}: no such topic ({meta and meta.error})")
        self._parts = [self.part(p) for p in sorted(meta.partitions)]
        return self._parts

    def _assign(self, consumer) -> dict[Part, int]:
        """Assign this rank's parts at their resume positions; their end offsets now."""
        from confluent_kafka import OFFSET_BEGINNING, TopicPartition

        mine = share(self._list(consumer), *self.reading.part)
        starts = {p: p.resume(self.ledger).row for p in mine}
        consumer.assign([TopicPartition(self.topic, p.index, starts[p] or OFFSET_BEGINNING) for p in mine])
        ends = {
            p: consumer.get_watermark_offsets(TopicPartition(self.topic, p.index), TIMEOUT_S)[1] for p in mine
        }
        log.info("reading %s partitions %s from offsets %s", self.topic, [p.index for p in mine],
                 [starts[p] for p in mine])  # fmt: skip
        return ends

    def _chunks(self, msgs: list, producer) -> Iterator[tuple[Part, KeyedChunk]]:
        good = [m for m in msgs if m.error() is None]  # the accessors confluent-kafka forces
        for m in msgs if len(good) < len(msgs) else ():
            if m.error() is not None:
                log.error("%s: consume error: %s", self.topic, m.error())
        if not good:
            return
        parts = np.fromiter((m.partition() for m in good), np.int64, len(good))
        offsets = np.fromiter((m.offset() for m in good), np.int64, len(good))
        values = [m.value() or b"" for m in good]
        samples, bad = read_fitting(values, self.reading.schema)
        refused = np.zeros(len(good), bool)
        for i, why in bad:  # malformed records: the rare path
            refused[i] = True
            headers = dead_letter.headers(why, self.topic, parts[i], offsets[i])
            producer.produce(self.dead_topic, values[i], good[i].key(), headers=headers)
            log.warning("%s/%d@%d to %s: %s", self.topic, parts[i], offsets[i], self.dead_topic, why)
        if bad and producer.flush(TIMEOUT_S):  # acknowledged before the offsets past them count
            raise RuntimeError(f"dead letters to {self.dead_topic} not acknowledged in {TIMEOUT_S} s")
        row_part = parts[samples.index]
        for p in np.unique(parts).tolist():
            mine = parts == p
            rows = np.flatnonzero(row_part == p)
            keyed = Keyed(take(samples, rows), self.reading.schema)
            first, last = int(offsets[mine].min()), int(offsets[mine].max())
            part = self.part(p)
            yield part, KeyedChunk(keyed, Position(part.unit, first), last + 1, int(refused[mine].sum()))

    def __str__(self) -> str:
        return f"kafka://{self.brokers}/{self.topic}"


def _open(where: str, reading: Reading, ledger: Ledger | None) -> KafkaSamples:
    brokers, topic = parse(where)
    if ledger is None:
        raise ValueError(f"kafka://{where}: a stream is read with a ledger of the offsets consumed")
    return KafkaSamples(brokers, topic, reading, ledger)


KIND = register(SourceKind("kafka", _open, keyed=True))
