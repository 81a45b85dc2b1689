"""The samples of one experiment, read from the samples topic from the experiment's start.

``SampleReader(cfg, span)`` reads, in order:

1. every partition of ``cfg.samples`` from the first record whose Kafka timestamp is at or after
   ``span.started - SEEK_MARGIN_S`` (``offsets_for_times``; a partition the broker answers no
   offset for -- none so recent, or a broker without timestamp lookups such as librdkafka's mock
   cluster -- from its beginning). Nothing is committed: a restarted watcher reads the same
   samples again and recomputes the same figures;
2. each ``read`` consumes up to ``BATCH`` records and reads them together
   (``stream.sample_batch.read_samples``, no Python loop per record);
3. keeps the samples of the experiment: its arm is one of ``span.arms`` and the impression was
   scored (``ts``) at or after ``span.started`` (and, once it ended, at or before ``span.ended``).
   The margin and the ``ts`` test make the set exact whatever the producers' clocks: a sample's
   Kafka timestamp is when the joiner produced it, after its impression was scored.

Nothing is dropped silently (``ReadCounts``): a record that is not a sample is counted and skipped
(dead-lettering is the trainer's job), a sample of another arm or outside the span is counted as
foreign.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition
from numpy.typing import NDArray

from stream.config import FETCH_WAIT_MS, kafka_settings
from stream.sample_batch import Samples, read_samples
from stream.watch.config import WatchConfig

log = logging.getLogger("recserve.experiment")
SEEK_MARGIN_S = 60.0
"""How far before the experiment's start the reader seeks (Kafka timestamps are producers' clocks)."""
BATCH = 5000
"""Records consumed per read."""
OTHER_LAYOUT = "sample has (slots, dense values)"
"""How ``read_samples`` begins the reason of a valid sample of another layout than the read's first."""


class WatchError(RuntimeError):
    """The watcher cannot read: Kafka unreachable or the samples topic missing."""


@dataclass(frozen=True)
class Span:
    """What makes a sample the experiment's: its arm and when its impression was scored."""

    started: float
    arms: tuple[str, ...]
    ended: float | None = None


@dataclass
class ReadCounts:
    """What the reader saw since it started (the experiment's start)."""

    records: int = 0
    """Records consumed."""
    bad: int = 0
    """Records skipped: not valid samples, or a label not 0 or 1 or a score outside [0, 1]."""
    foreign: int = 0
    """Samples of no arm of the experiment, or scored outside its span."""
    kept: int = 0
    """Samples of the experiment's arms."""


@dataclass(frozen=True)
class Chunk:
    """The experiment's samples of one read, as ``stream.arms.ArmsAccumulator.update`` takes them."""

    arm: NDArray[np.str_]
    score: NDArray[np.float64]
    label: NDArray[np.float64]
    ts: NDArray[np.float64]
    request: NDArray[np.str_]

    def __len__(self) -> int:
        return len(self.arm)


@dataclass
class SampleReader:
    cfg: WatchConfig
    span: Span
    counts: ReadCounts = field(default_factory=ReadCounts)

    def __post_init__(self) -> None:
        self._arms = np.array([a.encode() for a in self.span.arms], dtype=np.bytes_)
        settings = {"bootstrap.servers": self.cfg.brokers, **kafka_settings(self.cfg.kafka_config)}
        self.consumer = Consumer({"group.id": self.cfg.group, "enable.auto.commit": False,
                                  "fetch.wait.max.ms": FETCH_WAIT_MS, **settings})  # fmt: skip
        try:
            self.consumer.assign(self._start_offsets())
        except BaseException:
            self.consumer.close()
            raise

    def _start_offsets(self) -> list[TopicPartition]:
        topic = self.cfg.samples
        parts = partitions(self.consumer, self.cfg)
        at_ms = int((self.span.started - SEEK_MARGIN_S) * 1000)
        try:
            found = self.consumer.offsets_for_times(
                [TopicPartition(topic, p, at_ms) for p in parts], timeout=10
            )
        except KafkaException as e:
            raise WatchError(
                f"cannot look up {topic}'s offsets at {self.cfg.brokers}: {e.args[0].str()}"
            ) from None
        starts = [
            TopicPartition(topic, tp.partition, tp.offset if tp.offset >= 0 else OFFSET_BEGINNING)
            for tp in found
        ]
        where = {tp.partition: tp.offset if tp.offset >= 0 else "its beginning" for tp in starts}
        log.info("experiment watch: reading %s from offsets %s", topic, where)
        return starts

    def read(self, timeout_s: float = 0.1) -> Chunk:
        """The experiment's samples among the next records (an empty chunk when none came)."""
        values = []
        for m in self.consumer.consume(BATCH, timeout=timeout_s):
            err = m.error()
            if err is None:
                values.append(m.value() or b"")
            else:
                log.warning("experiment watch: consumer: %s", err.str())
        self.counts.records += len(values)
        return self._keep(_read_all(values, self.counts))

    def _keep(self, parts: list[Samples]) -> Chunk:
        arm = np.concatenate([s.arms for s in parts]) if parts else np.zeros(0, np.bytes_)
        ts = np.concatenate([s.ts for s in parts]) if parts else np.zeros(0)
        score = np.concatenate([s.scores for s in parts]).astype(np.float64) if parts else np.zeros(0)
        label = np.concatenate([s.labels for s in parts]).astype(np.float64) if parts else np.zeros(0)
        sane = ((label == 0) | (label == 1)) & (score >= 0) & (score <= 1)  # what the metrics take
        if not sane.all():
            log.warning("experiment watch: %d samples with a label not 0 or 1 or a score outside [0, 1] (skipped)",
                        int((~sane).sum()))  # fmt: skip
        mine = np.isin(arm, self._arms) & (ts >= self.span.started)
        if self.span.ended is not None:
            mine &= ts <= self.span.ended
        self.counts.bad += int((~sane).sum())
        self.counts.foreign += int((~mine & sane).sum())
        mine &= sane
        self.counts.kept += int(mine.sum())
        keys = np.concatenate([s.keys for s in parts]) if parts else np.zeros(0, np.bytes_)

        return Chunk(
            np.char.decode(arm[mine], "utf-8"), score[mine], label[mine], ts[mine], request_ids(keys[mine])
        )

    def close(self) -> None:
        self.consumer.close()


def partitions(consumer: Consumer, cfg: WatchConfig) -> list[int]:
    """The samples topic's partitions; WatchError naming what is wrong."""
    try:
        topics = consumer.list_topics(cfg.samples, timeout=10).topics
    except KafkaException as e:
        raise WatchError(f"cannot reach Kafka at {cfg.brokers}: {e.args[0].str()}") from None
    t = topics.get(cfg.samples)
    if t is None or t.error is not None or not t.partitions:
        raise WatchError(
            f"topic {cfg.samples!r} does not exist at {cfg.brokers} (--samples names the joined samples)"
        )
    return sorted(t.partitions)


def _read_all(values: list[bytes], counts: ReadCounts) -> list[Samples]:
    """Every valid sample of ``values``, in groups of one layout each: ``read_samples`` reads one
    (slots, dense values) layout at a time, so the records of another layout are read again on
    their own (one more pass per layout, never one per record); every other record is counted bad."""
    out: list[Samples] = []
    index = np.arange(len(values))
    while values:
        samples, bad = read_samples(values)
        if samples.num_rows:
            out.append(samples)
        again = [i for i, why in bad if why.startswith(OTHER_LAYOUT)]
        if len(again) == len(values):  # no progress: none of them reads
            again = []
        retry = set(again)
        refused = [(i, why) for i, why in bad if i not in retry]
        if refused:
            counts.bad += len(refused)
            i, why = refused[0]
            log.warning("experiment watch: %d records are not samples (skipped), e.g. #%d of a read: %s",
                        len(refused), index[i], why)  # fmt: skip
        values, index = [values[i] for i in again], index[again]
    return out


def request_ids(keys: NDArray[np.bytes_]) -> NDArray[np.str_]:
    """The request ids of sample keys (the item as 4 big-endian bytes, then the request id)."""
    width = keys.dtype.itemsize
    if width <= 4 or not len(keys):
        return np.zeros(len(keys), np.str_)
    raw = np.ascontiguousarray(keys).view(np.uint8).reshape(len(keys), width)[:, 4:]
    return np.char.decode(np.ascontiguousarray(raw).view(f"S{width - 4}").ravel(), "utf-8")
