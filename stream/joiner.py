"""``recserve join``: a consumer-group member that feeds the impressions and events of its
partitions to one ``PartitionJoin`` each and produces what they return.

Start-up, in order:
1. check the topics: impressions and events exist with the same partition count (a request's
   impression and events are in the same partition number: both keyed by request id, produced
   with the same partitioner), samples and the dead-letter topics exist;
2. subscribe with the ``range`` assignor, which gives a member the same partition numbers of both
   topics; or, with ``--member I/N``, assign itself the partitions p % N == I of both (no
   rebalancing: a restart reads again at once, where a group hands a dead member's partitions on
   only after its session timeout). Each partition gets a fresh join, which rebuilds its open
   windows by reading from the group's committed offsets;
3. loop: consume a batch, join it, close the windows the watermark passed, produce, serve delivery
   callbacks (each acknowledges a sample to its join), and every ``commit_every_s`` commit each
   input's ``committable`` offset -- only ever records whose samples are all acknowledged.

A delivery that fails after librdkafka's retries is fatal: the joiner stops without committing
(exit 1) and its restart re-reads what was not committed. On a rebalance the revoked partitions'
samples are flushed and their offsets committed before another member takes them.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from stream import dead_letter
from stream.config import FETCH_WAIT_MS, JoinConfig, kafka_settings
from stream.guard import InputGuard
from stream.join import EVENTS, IMPRESSIONS, Emit, JoinCounts, PartitionJoin
from stream.journal import Journal
from stream.spill import Spill, spill_root

log = logging.getLogger("recserve.join")
READ_TO = "read_to="
"""The metadata of a committed offset: the next offset the joiner had read when it committed."""


class JoinError(RuntimeError):
    """The joiner cannot run (topics missing or not co-partitioned) or a sample was not delivered."""


class Joiner:
    def __init__(
        self, cfg: JoinConfig, registry: Any = None, read_to_end: Callable[[], None] | None = None
    ) -> None:
        self.cfg, self.counts, self.read_to_end = cfg, JoinCounts(), read_to_end
        self.parts: dict[int, PartitionJoin] = {}
        self.fatal = ""
        self._committed: dict[tuple[int, int], tuple[int, int]] = {}  # (input, partition): (offset, read to)
        common = {"bootstrap.servers": cfg.brokers, **kafka_settings(cfg.kafka_config)}
        self.producer = Producer({"enable.idempotence": True, "linger.ms": 5,
                                  "queue.buffering.max.messages": 1_000_000, **common})  # fmt: skip
        self.consumer = Consumer({"group.id": cfg.group, "enable.auto.commit": False, "fetch.wait.max.ms": FETCH_WAIT_MS,
                                  "auto.offset.reset": "earliest", "enable.partition.eof": True,
                                  "partition.assignment.strategy": "range", "queued.max.messages.kbytes": 16384, **common})  # fmt: skip
        self._topics = (cfg.impressions, cfg.events)
        self._spills = spill_root(cfg)  # where closed requests' impressions lie (--attribution-s)
        self._closing = False
        self._dead_letters = cfg.dead_letters()
        self.guard = InputGuard(cfg.guard)
        self._held_for = ""  # why the guard last held the join
        self._seen: tuple[int, int, np.ndarray | None] = (
            0,
            0,
            None,
        )  # items, events, empty rows the guard was told of
        self.partitions = 0
        """The inputs' partition count (``check_topics``)."""
        self._at_end: set[tuple[int, int]] | None = set()  # (input, partition) at its end; None: hook called
        if registry is not None:
            from stream.join_metrics import Collector

            registry.register(Collector(self))

    # --- start-up ------------------------------------------------------------------------
    def check_topics(self, timeout_s: float = 10.0) -> int:
        """The partition count of the inputs; JoinError naming what is missing or unequal."""
        try:
            topics = self.consumer.list_topics(timeout=timeout_s).topics
        except KafkaException as e:
            raise JoinError(f"cannot reach Kafka at {self.cfg.brokers}: {e.args[0].str()}") from None
        c = self.cfg
        quarantine = (c.quarantine_topic(),) if c.guard.enabled else ()
        wanted = dict.fromkeys((c.impressions, c.events, c.samples, *quarantine, *c.dead_letters()))
        missing = [t for t in wanted if t not in topics or topics[t].error is not None]
        if missing:
            hint = "" if c.dead_letter else "; --dead-letter TOPIC sends every dead letter to one topic"
            if c.guard.enabled and c.quarantine_topic() in missing:
                hint += f"; {c.quarantine_topic()} takes the samples the input guard quarantines (--no-input-guard: none)"
            raise JoinError(f"topics {missing} do not exist at {c.brokers} (create them first{hint})")
        counts = {t: len(topics[t].partitions) for t in self._topics}
        if len(set(counts.values())) != 1:
            raise JoinError(f"impressions and events must have the same number of partitions, got {counts}")
        self.partitions = counts[c.impressions]
        members = c.members()
        if members is not None and members[0] >= self.partitions:
            raise JoinError(f"member {c.member} has no partition: the inputs have {self.partitions}")
        return self.partitions

    # --- the loop ------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Join until ``stop`` is set (then flush and commit) or a delivery fails (JoinError)."""
        members = self.cfg.members()
        if members is None:
            self.consumer.subscribe(list(self._topics), on_assign=self._assigned, on_revoke=self._revoked,
                                    on_lost=self._lost)  # fmt: skip
        else:  # at the group's committed offsets (auto.offset.reset where none is)
            i, n = members
            mine = [TopicPartition(t, p) for t in self._topics for p in range(self.partitions or self.check_topics())
                    if p % n == i]  # fmt: skip
            self._assigned(self.consumer, mine)
            self.consumer.assign(mine)
        last_commit = last_log = time.monotonic()
        last_judged = 0.0
        try:
            while not stop.is_set() and not self.fatal:
                msgs = self.consumer.consume(self.cfg.batch, timeout=0.1)
                now = time.time()
                for m in msgs:
                    self._take(m, now)
                if self.cfg.guard.enabled:
                    self._tell_guard(now)
                    if now - last_judged >= 1.0:
                        self._judge(now)
                        last_judged = now
                for p, part in list(self.parts.items()):
                    self._produce(p, part.advance(now))
                self.producer.poll(0)
                if time.monotonic() - last_commit >= self.cfg.commit_every_s:
                    self.commit()
                    last_commit = time.monotonic()
                if time.monotonic() - last_log >= 10:
                    log.info(
                        "join: %s, %d windows open",
                        self.counts,
                        sum(p.open_windows for p in self.parts.values()),
                    )
                    last_log = time.monotonic()
            if not self.fatal:
                self.producer.flush(30)
                self.commit()
        finally:
            self._closing = True  # the partitions' spills and journals stay for the restart
            if self.fatal:  # nothing more is committed: a restart re-reads it
                for p in list(self.parts):
                    self._drop(p)
            self.consumer.close()  # leaves the group (a revoke: flush and commit what is done)
            for p in list(self.parts):
                self._drop(p)
        if self.fatal:
            raise JoinError(self.fatal)

    # --- the input guard ------------------------------------------------------------------
    def _tell_guard(self, now: float) -> None:
        """What entered since the last call: items impressed, events, empty rows per slot. What a
        restart re-reads that the run before it handled is no input: a restarted joiner re-reads
        the events of requests it had settled (their impressions' offsets committed past), and a
        label rate of those would form the guard's band too high (bench-soak: tripped at once,
        never cleared). An event read before its impression counts once placed (``waiting``): a
        re-read click of a settled request waits there until it is late, so replayed."""
        c, (items, events, empty) = self.counts, self._seen
        now_items = c.items - c.replayed_items
        now_events = c.events - c.replayed - sum(part.waiting for part in self.parts.values())
        rows, new = c.empty_rows, None
        if rows is not None:
            new = rows - empty if empty is not None and len(empty) == len(rows) else rows
        if now_items != items or now_events != events:
            self.guard.saw(now, now_items - items, now_events - events, new)
            self._seen = (now_items, now_events, None if rows is None else rows.copy())

    def _judge(self, now: float) -> None:
        """Judge the input; hold every partition's windows while the guard is tripped."""
        was = self.guard.trip
        trip = self.guard.judge(now, {p: (part.event_lag(), part.items) for p, part in self.parts.items()})
        if (was is None) != (trip is None) and self.cfg.record_to:
            self._record(*(("trip", trip.reason) if trip is not None else ("clear", self.guard.cleared)))
        if trip is not None:
            self._held_for = trip.reason  # the quarantine's reason, until the next trip
        if was is not None and trip is None:
            self._release(now)
        hold = self.cfg.guard.hold_s if trip is not None else None
        for part in self.parts.values():
            part.hold_s = hold

    def _release(self, now: float) -> None:
        """The guard cleared: the held windows close, as usual if their clicks came (the label rate
        of those impressed while it held is back at the guard's clear share of the band), else to
        the quarantine topic."""
        # judged on the windows of impressions read while it held (those before it had their
        # clicks before the outage), else on every held one
        for suspect in (True, False):
            held = [part.held_labels(now, suspect) for part in self.parts.values()]
            items, labelled = sum(h[0] for h in held), sum(h[1] for h in held)
            if items:
                break
        g = self.guard
        quarantine = bool(items) and labelled / items < self.cfg.guard.clear * g.band
        if items:
            log.warning("input guard cleared: %d held items, %d labelled (%.4f against the band's %.4f): %s",
                        items, labelled, labelled / items, g.band, "quarantined" if quarantine else "joined as usual")  # fmt: skip
        for p, part in list(self.parts.items()):
            self._produce(p, part.release(now, quarantine))

    def _record(self, event: str, reason: str) -> None:
        from model_store.guards import GuardEvent, record_or_log

        record_or_log(self.cfg.record_to, GuardEvent("input", event, reason))

    def _take(self, m: Message, now: float) -> None:
        err = m.error()
        inp = IMPRESSIONS if m.topic() == self._topics[0] else EVENTS
        part = self.parts.get(m.partition())  # type: ignore[arg-type]
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                if part is not None:
                    part.caught_up(inp)
                    self._read_to_end(inp, m.partition())  # type: ignore[arg-type]
                return
            if err.fatal():
                self.fatal = f"consumer: {err.str()}"
            log.warning("consumer: %s", err.str())
            return
        if part is None:  # a record of a partition revoked in this batch
            return
        value, offset = m.value() or b"", m.offset()
        assert offset is not None
        out = part.impression(offset, value, now) if inp == IMPRESSIONS else part.event(offset, value, now)
        self._produce(m.partition(), out)  # type: ignore[arg-type]

    def _read_to_end(self, inp: int, partition: int) -> None:
        """Once every input of every partition was read to its end after an assignment (a
        restart's backlog read), call ``read_to_end`` (``recserve join``: give the allocator's
        free pages back; librdkafka queued up to ``queued.max.messages.kbytes`` of the backlog's
        impressions, 16 MB here, and glibc kept those pages after they were freed: bench-soak's
        restarted joiner settled 64-100 MB above the one killed)."""
        if self._at_end is None:
            return
        self._at_end.add((inp, partition))
        if len(self._at_end) == 2 * len(self.parts):
            self._at_end = None
            if self.read_to_end is not None:
                self.read_to_end()

    def _produce(self, partition: int, emits: list[Emit]) -> None:
        """Each emit's records, under one delivery callback per emit: one per record kept a live
        object per sample in flight, and walking them took the garbage collector 40% of the
        joiner's time (bench-join)."""
        produce = self.producer.produce
        for e in emits:
            topic = self.cfg.samples
            headers: list[tuple[str, str | bytes | None]] | None = None
            if e.dead:  # token: (input, offset) of the malformed record
                inp, offset = cast(tuple[int, int], e.token)
                topic = self._dead_letters[inp]
                headers = dead_letter.headers(e.reason, self._topics[inp], partition, offset)
            elif e.quarantine:
                topic = self.cfg.quarantine_topic()
                headers = [("reason", f"input guard: {self._held_for}")]
            callback, key = functools.partial(self._delivered, partition, e.token), e.key or None
            for value in e.values:
                try:
                    produce(topic, value, key, -1, callback, headers=headers)
                except BufferError:  # the local queue is full
                    self._produce_when_room(topic, value, key, callback, headers)

    def _produce_when_room(self, topic: str, value: bytes, key: bytes | None, callback: Any,
                           headers: Any) -> None:  # fmt: skip
        """Produce one record once the local queue has room (deliveries drain it)."""
        while True:
            self.producer.poll(0.05)
            try:
                self.producer.produce(topic, value, key, -1, callback, headers=headers)
                return
            except BufferError:
                continue

    def _delivered(self, partition: int, token: object, err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            self.fatal = f"a sample or dead letter was not delivered: {err.str()}"
            return
        part = self.parts.get(partition)
        if part is not None:
            part.acked(token)

    # --- offsets and rebalancing ---------------------------------------------------------
    def commit(self, partitions: list[int] | None = None) -> None:
        """Each input's ``committable`` offset, with how far it was read as the commit's metadata
        (``READ_TO``: a restart tells a re-read event from a late one by it)."""
        marks: dict[tuple[int, int], tuple[int, int]] = {}
        for p in self.parts if partitions is None else partitions:
            part = self.parts[p]
            for inp, offset in enumerate(part.offsets.committable()):
                mark = (offset, part.offsets.next[inp])
                if offset >= 0 and self._committed.get((inp, p)) != mark:
                    marks[(inp, p)] = mark
        if not marks:
            return
        offsets = [TopicPartition(self._topics[inp], p, offset, metadata=f"{READ_TO}{read_to}")
                   for (inp, p), (offset, read_to) in marks.items()]  # fmt: skip
        try:
            self.consumer.commit(offsets=offsets, asynchronous=False)
        except KafkaException as e:  # e.g. mid-rebalance: the next commit carries it
            log.warning("commit failed (retried at the next): %s", e.args[0].str())
            return
        self._committed.update(marks)

    def _resume(self, tps: list[TopicPartition]) -> set[int]:
        """Tell each assigned partition's join how far the run before read it (the metadata of
        its committed offsets; none: nothing to tell); the partitions whose impressions the group
        never committed (fresh: a journal there is another run's)."""
        try:
            committed = self.consumer.committed(tps, timeout=10)
        except KafkaException as e:  # no coordinator yet: every re-read late event counts as late
            log.warning("could not read the committed offsets' metadata: %s", e.args[0].str())
            return set()
        fresh = {tp.partition for tp in committed if tp.topic == self._topics[0] and tp.offset < 0}
        for tp in committed:
            if tp.metadata and tp.metadata.startswith(READ_TO) and tp.partition in self.parts:
                inp = self._topics.index(tp.topic)
                self.parts[tp.partition].offsets.replay_to[inp] = int(tp.metadata.removeprefix(READ_TO))
        return fresh

    def _assigned(self, _consumer: Consumer, tps: list[TopicPartition]) -> None:
        by_topic = [{tp.partition for tp in tps if tp.topic == t} for t in self._topics]
        if by_topic[0] != by_topic[1]:
            self.fatal = (f"assigned impressions partitions {sorted(by_topic[0])} but events partitions "
                          f"{sorted(by_topic[1])}: every member must use partition.assignment.strategy=range")  # fmt: skip
        new = sorted(by_topic[0] - set(self.parts))
        if new:
            self._at_end = set()
        for p in new:  # a fresh join: it re-reads what is not committed
            self.parts[p] = self._join(p)
        for p in by_topic[0]:
            part = self.parts[p]
            if self.guard.tripped:
                part.hold_s = self.cfg.guard.hold_s
            self._committed.pop((IMPRESSIONS, p), None)
            self._committed.pop((EVENTS, p), None)
        fresh = self._resume(tps)
        for p in new:  # what its journal says was settled before (another run's: forgotten)
            journal, spill = self.parts[p].journal, self.parts[p].spill
            if journal is not None and spill is not None and p in fresh:
                journal.clear()
                spill.clear()
            elif journal is not None:
                self.parts[p].restore(journal.replay())
        log.info("join: assigned partitions %s", sorted(by_topic[0]))

    def _join(self, p: int) -> PartitionJoin:
        """Partition ``p``'s join, with its spill and journal under the state directory."""
        spill = journal = None
        if self._spills is not None:
            base = self._spills / f"{self.cfg.impressions}-{p}"
            spill = Spill(base, self.cfg.spill_bucket_s(), keep=True)
            journal = Journal(self._spills / f"{self.cfg.impressions}-{p}.journal")
        c = self.cfg
        return PartitionJoin(c.label_after_s, self.counts, c.attribution_s, spill, journal, c.events_idle_s)

    def _revoked(self, _consumer: Consumer, tps: list[TopicPartition]) -> None:
        gone = sorted({tp.partition for tp in tps} & set(self.parts))
        if not self.fatal:
            self.producer.flush(30)
            self.commit(gone)
        for p in gone:
            self._drop(p)
        log.info("join: revoked partitions %s", gone)

    def _lost(self, _consumer: Consumer, tps: list[TopicPartition]) -> None:
        for tp in tps:
            self._drop(tp.partition)

    def _drop(self, p: int) -> None:
        """Forget partition ``p``'s join; its spill and journal too unless the joiner is closing
        (then they stay for its restart)."""
        part = self.parts.pop(p, None)
        if part is None or part.spill is None or part.journal is None:
            return
        if not self._closing:  # another member has it now
            part.spill.clear()
            part.journal.clear()
        part.spill.close()
        part.journal.close()
