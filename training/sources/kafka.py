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
forces), on a reading thread that consumes and decodes up to ``CONSUMES_AHEAD`` consumes ahead of
the trainer's step, handing each over whole (its looks: one hand-over between the threads a
consume, not one a look): each look's chunks share a ``Look`` with the batch of all its samples
(the step takes it as it is unless a sample in it was trained already) and the batches of the
``CONSUMES_AHEAD`` looks read after it (the step looks their rows up while it trains). With a backlog one consume takes up to
``READ_ROWS`` records, cut into looks of the batch size (a consume call costs about as much for
128 records as for 2,048). A malformed record, or one that does not fit the followed schema, goes
to the dead-letter topic ``<TOPIC>.dead`` as it was, with headers saying why and where
(``stream.dead_letter``), counted in the chunk's ``refused``; the trainer goes on.

Reading with ``once``: end when every partition is read up to its end as it was at the start.
librdkafka settings come from ``RECSERVE_KAFKA_*`` variables (``RECSERVE_KAFKA_SECURITY_PROTOCOL=
SASL_SSL`` sets ``security.protocol``): SASL/TLS for real brokers.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
from numpy.typing import NDArray

from stream import dead_letter
from stream.config import FETCH_WAIT_MS
from stream.sample_batch import Samples, read_fitting, span, take, to_batches
from training.sources.ledger import Ledger
from training.sources.registry import SourceKind, register
from training.sources.types import (
    TICK,
    Keyed,
    KeyedChunk,
    KeyedSpan,
    Look,
    Part,
    Position,
    Reading,
    TableChunk,
    share,
)

log = logging.getLogger("recserve.train.follow")

TIMEOUT_S = 10.0  # metadata, watermarks and dead-letter acknowledgements
CONSUMES_AHEAD = 2  # consumes decoded ahead of the trainer's step, on the reading thread
READ_ROWS = 2048  # records one consume takes when a backlog waits (then cut into looks of the batch)
SLICE_S = 0.05  # the reading thread's longest wait in one consume (how soon it sees the trainer end)


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
    _ahead: deque[Look | None] = field(default_factory=deque, init=False)  # looks read, not yielded
    _read: dict[int, int] = field(default_factory=dict, init=False)  # partition -> next offset read
    _skipped: int = field(default=0, init=False)  # records gone when read past (``skipped``)

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

        from training.data import in_background

        conf = settings(self.brokers)
        consumer = self._open_consumer()
        producer = Producer(conf | {"acks": "all", "enable.idempotence": True})
        try:
            ends = self._assign(consumer)
            self._at = {p: p.resume(self.ledger).row for p in ends}
            self._ends, self._consumer = dict(ends), consumer
            self._read = {p.index: at for p, at in self._at.items()}
            stop_at = {p.index: end for p, end in ends.items()} if self.reading.once else None
            halt = threading.Event()
            consumes = in_background(self._looks(consumer, producer, halt, stop_at), depth=CONSUMES_AHEAD)
            looks: deque[list[tuple[Part, KeyedChunk]]] = deque()  # of the consume handed over last
            try:
                while True:
                    yield TICK
                    if self.reading.once and all(self._at[p] >= ends[p] for p in ends):
                        return
                    if not looks:
                        looks.extend(next(consumes, ()))
                    if not looks:  # with ``once``: the reading thread read to the ends, all yielded
                        return
                    look = looks.popleft()
                    self._ahead.popleft()
                    whole = look[0][1].look if look else None
                    if whole is not None:  # the batches read after it, for the trainer's row lookups ahead
                        after = (x.batch for x in self._ahead if x is not None and x.batch is not None)
                        whole.after = tuple(itertools.islice(after, CONSUMES_AHEAD))
                    for part, chunk in look:
                        self._at[part] = chunk.end
                        yield chunk
            finally:
                halt.set()
                consumes.close()  # the reading thread stops (within a slice) before the consumer closes
        finally:
            self._consumer = None
            consumer.close()
            left = producer.flush(TIMEOUT_S)
            if left:
                log.error("%d dead letters to %s not acknowledged at exit", left, self.dead_topic)

    def _looks(
        self, consumer, producer, halt: threading.Event, stop_at: dict[int, int] | None = None
    ) -> Iterator[list[list[tuple[Part, KeyedChunk]]]]:
        """Each consume's looks, each look's chunks (one empty look: nothing came in ``fill_s``),
        consumed and decoded on the reading thread while the trainer steps on the looks before; it
        waits in slices, so a trainer that ends is not held up by a wait for records that will not
        come. ``stop_at``
        (``once``: each partition's end at the start): a look waits for no more records than are
        left before the ends (the last look of a catch-up is not held ``fill_s`` for records the
        run will not train), and the reading ends once every partition is read that far."""
        wait = self.reading.poll_s if self.reading.fill_s is None else self.reading.fill_s
        n = self.reading.batch_rows
        while not halt.is_set():
            left_once = (
                None if stop_at is None else sum(max(0, e - self._read[p]) for p, e in stop_at.items())
            )
            if left_once == 0:
                return
            want = n if left_once is None else min(n, left_once)
            deadline = time.monotonic() + wait
            # once however short the wait, then in slices until the batch fills or the wait ends
            msgs = consumer.consume(num_messages=want, timeout=min(wait, SLICE_S))
            while len(msgs) < want and not halt.is_set() and (left := deadline - time.monotonic()) > 0:
                msgs += consumer.consume(num_messages=want - len(msgs), timeout=min(left, SLICE_S))
            if len(msgs) == n and READ_ROWS > n:  # a backlog: what is there already, in one call
                msgs += consumer.consume(num_messages=READ_ROWS - n, timeout=0)
            self._seen_ends(consumer)
            read = self._decode(msgs, producer)  # the whole consume at once, then cut into looks
            looks = list(self._cut(read, n))  # looks of the batch size at most
            self._ahead.extend(look[0][1].look if look else None for look in looks)
            yield looks

    def skipped(self) -> int:
        return self._skipped

    def behind(self) -> int | None:
        """Records of this rank's partitions after those yielded: each partition's end offset as
        the reading thread last saw it (``_seen_ends``) less where it stands; None before the
        partitions are assigned."""
        if self._consumer is None:
            return None
        return sum(max(0, self._ends[p] - at) for p, at in self._at.items())

    def _seen_ends(self, consumer) -> None:
        """Each partition's end offset as the consumer last saw it (librdkafka's cached high
        watermark, updated by every fetch: no request), asked on the reading thread: a call from
        another one waits for its consume."""
        from confluent_kafka import TopicPartition

        for p in self._at:
            hi = consumer.get_watermark_offsets(TopicPartition(self.topic, p.index), cached=True)[1]
            self._ends[p] = max(self._ends[p], hi)  # no fetch yet: the end found at the start

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

    def _decode(self, msgs: list, producer) -> tuple[Samples, NDArray[np.int64], NDArray[np.int64], NDArray[np.bool_]]:  # fmt: skip
        """A consume's records that came without an error, decoded together: (the valid samples,
        each record's partition, offset, and whether it was refused: sent to the dead-letter topic)."""
        from confluent_kafka import Message

        # the accessors confluent-kafka forces, each mapped in C (no bytecode per record)
        errors = list(map(Message.error, msgs))
        good = (
            msgs
            if errors.count(None) == len(msgs)
            else [m for m, e in zip(msgs, errors, strict=True) if e is None]
        )
        for e in errors if len(good) < len(msgs) else ():
            if e is not None:
                log.error("%s: consume error: %s", self.topic, e)
        parts = np.fromiter(map(Message.partition, good), np.int64, len(good))
        offsets = np.fromiter(map(Message.offset, good), np.int64, len(good))
        raw: list[bytes | None] = list(map(Message.value, good))
        # a record without a value: malformed, refused below
        values: list[bytes] = [v or b"" for v in raw] if None in raw else cast("list[bytes]", raw)
        samples, bad = read_fitting(values, self.reading.schema)
        refused = np.zeros(len(good), bool)
        for i, why in bad:  # malformed records: the rare path
            refused[i] = True
            headers = dead_letter.headers(why, self.topic, parts[i], offsets[i])
            producer.produce(self.dead_topic, values[i], good[i].key(), headers=headers)
            log.warning("%s/%d@%d to %s: %s", self.topic, parts[i], offsets[i], self.dead_topic, why)
        if bad and producer.flush(TIMEOUT_S):  # acknowledged before the offsets past them count
            raise RuntimeError(f"dead letters to {self.dead_topic} not acknowledged in {TIMEOUT_S} s")
        return samples, parts, offsets, refused

    def _cut(self, read, n: int) -> Iterator[list[tuple[Part, KeyedChunk]]]:
        """The looks of a decoded consume, ``n`` records each at most (one empty look when it holds
        none): each look's chunks, one per partition. The whole consume at once: its samples put
        look by look, partition by partition in each (one gather), every look's batch
        (``to_batches``: one compiled call, no GIL held), and the (look, partition) groups' offsets
        and refused counts; a look's samples and batch are views of those."""
        samples, parts, offsets, refused = read
        if not len(parts):
            yield []
            return
        looks, width = -(-len(parts) // n), int(parts.max()) + 1
        group = np.arange(len(parts)) // n * width + parts  # each record's (look, partition)
        order = np.argsort(group[samples.index], kind="stable")  # rows: in record order in each group
        samples = take(samples, order)
        row_group = group[samples.index]
        bounds = np.searchsorted(row_group, np.arange(looks + 1) * width)  # each look's rows
        batches = to_batches(samples, bounds, self.reading.schema)
        by = np.argsort(group, kind="stable")  # the records, group by group
        present, begins = np.unique(group[by], return_index=True)
        first = np.minimum.reduceat(offsets[by], begins)
        last = np.maximum.reduceat(offsets[by], begins)
        n_refused = np.add.reduceat(refused[by].astype(np.int64), begins)
        since, until = (
            np.searchsorted(row_group, present, "left"),
            np.searchsorted(row_group, present, "right"),
        )
        at = np.searchsorted(present, np.arange(looks + 1) * width).tolist()  # each look's groups
        rows, parts_of = bounds.tolist(), (present % width).tolist()
        since, until, first, last, n_refused = (x.tolist() for x in (since, until, first, last, n_refused))
        for k in range(looks):
            lo, g = rows[k], slice(at[k], at[k + 1])
            mine = parts_of[g]
            # a loop per partition of the look: records the offsets jumped past
            gone = sum(max(0, f - self._read[p]) for p, f in zip(mine, first[g], strict=True))
            if gone:  # offsets jumped: the broker no longer had them (or control records)
                self._skipped += gone
                log.error("%s: read past %d records the broker no longer had (its retention passed them "
                          "before they were read, or control records), %d so far", self.topic, gone, self._skipped)  # fmt: skip
            self._read.update((p, z + 1) for p, z in zip(mine, last[g], strict=True))
            whole = Keyed(span(samples, lo, rows[k + 1]), self.reading.schema)
            look = Look(whole, len(mine), batches[k] if rows[k + 1] > lo else None)
            yield [
                (part, KeyedChunk(KeyedSpan(whole, a - lo, b - lo), Position(part.unit, f), z + 1, r, look))
                for part, a, b, f, z, r in zip(
                    map(self.part, mine), since[g], until[g], first[g], last[g], n_refused[g], strict=True
                )
            ]

    def __str__(self) -> str:
        return f"kafka://{self.brokers}/{self.topic}"


def _open(where: str, reading: Reading, ledger: Ledger | None) -> KafkaSamples:
    brokers, topic = parse(where)
    if ledger is None:
        raise ValueError(f"kafka://{where}: a stream is read with a ledger of the offsets consumed")
    return KafkaSamples(brokers, topic, reading, ledger)


KIND = register(SourceKind("kafka", _open, keyed=True))
