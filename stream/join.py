"""The join of impressions and events into labelled samples, for one partition: a plain class,
no Kafka (``stream.joiner`` feeds it records and produces what it returns).

One sample per (request, item): **positive** (the event's label) when an event for the item
arrives within ``label_after_s`` of the impression (its first horizon, the "window"), **negative**
(0.0) for every item without one when the window closes. A second event for an item collapses into
the first (``duplicates``); an event after its window is ``late``: counted and dropped. A record
that cannot be read (or an event naming an item the request does not have, a ts more than ``SKEW_S``
before its impression's, or an unknown request, ``stream.recent``) goes to the dead-letter topic.

**Corrections** (``attribution_s`` > ``label_after_s``): a click after the item's first horizon
but within ``attribution_s`` of the impression emits a second sample of the item, positive, of kind
``CORRECTION`` with its delay (``elapsed``); one after ``attribution_s`` is late. Once its window
closes a request keeps only where its impression lies on local disk (``stream.spill``, read back
for a correction) and which items were clicked. Once its first labels are acknowledged it is
*settled*: written to the partition's journal (``stream.journal``) and its records released, so
offsets commit past it; a restart ``restore``s it, and its impression re-read is known, not seen
twice. A correction holds its event until acknowledged and journalled. (Without a journal a
request's records stay held until its attribution window is over.)

**Time** is event time: the join's watermark is the smallest of its two inputs' watermarks, each
the newest ``ts`` it delivered, advanced by the wall time since (a quiet input does not stop the
clock); an input caught up (at the end of its partition) does not hold the join back while the
other has records, but no window closes past the newest event until the events have been silent
``events_idle_s`` (``Clocks``). A window closes when the watermark passes ``impression.ts + window_s``; an attribution window ends once the events' own clock passes it too (a click in flight
while the impressions ran ahead still counts). Replaying a topic gives the labels a live run gave.

**The input guard** (``stream.guard``, judged by the joiner) may *hold* the join (``hold_s``):
windows then stay open up to ``hold_s`` past their close, so that clicks delayed by a broken
pipeline still label their items, and the samples of an open window wait for its close (a positive
too: nothing from a suspect stretch reaches the trainer early). When the guard clears, the windows
close when their clicks came (a stopped pipeline's, delayed): every sample a live join would have
produced by now, in its order (``release``, ``stream.live_order``); else as ``quarantine`` samples
(the held windows' label rate against the guard's band), as are those its bound closes.

**Offsets** (``offsets``, ``join_state.Offsets``): a record is *held* until all it led to is
acknowledged (an impression or event until its request's window closed and its samples were; a
dead letter until it was). ``committable()`` is each input's oldest held offset (or the next to
read): a restart from it re-reads exactly the open windows (their samples perhaps produced twice,
never lost), and events past it handled before: the joiner commits beside each offset how far it
had read (``next``), and an event below that mark (``replay_to``, after a restart) that finds no
open window is ``replayed``, not ``late`` again.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np

from features.codec import CodecError, decode
from stream.join_state import EVENTS, IMPRESSIONS, INPUTS, Clocks, Emit, JoinCounts, Offsets, _Request
from stream.journal import Journal, Settled
from stream.live_order import clicks_due, in_live_order
from stream.recent import KNOWN_FOR_S, DoneRequests
from stream.records import (
    CORRECTION,
    Event,
    RecordError,
    SampleWriter,
    decode_event,
    decode_impression,
    encode_event,
)
from stream.rows import RowTable
from stream.spill import Spill

__all__ = ["EVENTS", "IMPRESSIONS", "INPUTS", "Emit", "JoinCounts", "PartitionJoin"]
SKEW_S = 1.0
"""How far before its impression's an event's ts may be (clients' clocks are not the frontends')."""


class PartitionJoin:
    """The open windows of one partition (the same partition of the impressions and events)."""

    def __init__(self, label_after_s: float, counts: JoinCounts, attribution_s: float = 0.0, spill: Spill | None = None,
                 journal: Journal | None = None, events_idle_s: float = 0.0) -> None:  # fmt: skip
        if not label_after_s > 0:
            raise ValueError(f"label_after_s must be > 0, got {label_after_s}")
        if attribution_s and attribution_s < label_after_s:
            raise ValueError(f"attribution_s must be 0 (none) or >= label_after_s ({label_after_s}), got {attribution_s}")  # fmt: skip
        self.window_s, self.counts = label_after_s, counts
        self.attribution_s = max(attribution_s, label_after_s)
        self.correcting = self.attribution_s > label_after_s
        if self.correcting and spill is None:
            raise ValueError("attribution_s past label_after_s needs a spill (where closed requests' impressions lie)")  # fmt: skip
        self.spill, self.journal = spill, journal
        self._compacted = 0  # the journal's size after its last compaction
        self.requests: dict[str, _Request] = {}
        self._deadlines: list[tuple[float, str]] = []  # heap of open impressions' deadlines
        self._attributing: list[tuple[float, str]] = []  # heap of closed requests' attribution ends
        self._early: list[tuple[float, int, str, Event]] = []  # heap of early events' expiry
        self.offsets = Offsets()  # per input: held, next to read, handled by the run before a restart
        self._clocks = Clocks(events_idle_s)  # windows close once an event past them came (or idle_s)
        self.hold_s: float | None = None
        """While set (the input guard is tripped), windows stay open up to this long past their
        close and their samples wait for it; those the bound closes are quarantined."""
        self.items = 0  # items impressed in this partition
        self.waiting = 0
        """Events read before their impression, not placed yet: the input guard is told of an event
        once it is placed (a restart's re-read click waits here until it is late, so replayed)."""
        self.done = DoneRequests(max(2 * self.attribution_s, KNOWN_FOR_S))  # late, or unknown: a dead letter
        self._balance_until = float("-inf")  # event time: requests impressed before it defer their clicks

    # --- input ---------------------------------------------------------------------------
    def impression(self, offset: int, value: bytes, now: float) -> list[Emit]:
        self.offsets.read(IMPRESSIONS, offset)
        try:
            imp = decode_impression(value)
            batch = decode(imp.batch)
            if batch.num_rows != len(imp.scores):
                raise RecordError(f"impression has {len(imp.scores)} scores for {batch.num_rows} items")
        except (RecordError, CodecError) as e:
            return [self._dead(IMPRESSIONS, offset, value, f"impression: {e}")]
        self.counts.impressions += 1
        self.counts.items += batch.num_rows
        self.items += batch.num_rows
        rows = RowTable.of(batch)
        empty = (rows.lengths == 0).sum(axis=0)
        self.counts.empty_rows = empty if self.counts.empty_rows is None or len(self.counts.empty_rows) != len(empty) \
            else self.counts.empty_rows + empty  # fmt: skip
        self._clocks[IMPRESSIONS].saw(imp.ts, now)
        self.done.seen(imp.ts)
        req = self.requests.setdefault(imp.request_id, _Request())
        if req.labelled is not None:  # the same request id twice: the first impression stands
            if req.settled and req.offset == offset:  # re-read after a restart: it was settled before
                self.counts.replayed_items += batch.num_rows
                return []
            return [self._dead(IMPRESSIONS, offset, value, f"impression: request id {imp.request_id!r} seen twice")]  # fmt: skip
        req.deadline, req.ts, req.offset = imp.ts + self.window_s, imp.ts, offset
        if self.spill is not None:
            req.where = self.spill.put(imp.ts + self.attribution_s, value)
        req.suspect = self.hold_s is not None
        req.defer = req.suspect or imp.ts < self._balance_until
        req.writer = SampleWriter(imp, rows)
        req.labelled = np.zeros(batch.num_rows, bool)
        req.held.append((IMPRESSIONS, offset))
        self.offsets.hold(IMPRESSIONS, offset)
        heapq.heappush(self._deadlines, (req.deadline, imp.request_id))
        out: list[Emit] = []
        self.waiting -= len(req.early)
        for ev_offset, ev in req.early:
            out += self._apply(imp.request_id, req, ev_offset, ev)
        req.early = []
        return out

    def event(self, offset: int, value: bytes, now: float) -> list[Emit]:
        self.offsets.read(EVENTS, offset)
        try:
            ev = decode_event(value)
        except RecordError as e:
            return [self._dead(EVENTS, offset, value, f"event: {e}")]
        self.counts.events += 1
        self._clocks[EVENTS].saw(ev.ts, now)
        req = self.requests.get(ev.request_id)
        if req is not None and req.labelled is not None:
            return self._apply(ev.request_id, req, offset, ev)
        if ev.ts + self.window_s <= self.watermark(now):  # its impression's window is over
            return self._unplaced(offset, ev)
        req = self.requests.setdefault(ev.request_id, _Request())
        req.early.append((offset, ev))
        self.waiting += 1
        req.held.append((EVENTS, offset))
        self.offsets.hold(EVENTS, offset)
        heapq.heappush(self._early, (ev.ts + self.window_s, offset, ev.request_id, ev))
        return []

    def _unplaced(self, offset: int, ev: Event) -> list[Emit]:
        """An event no open or settled request takes: late, or a dead letter for an unknown request."""
        why = self.done.unknown(ev.request_id, ev.ts) if not self.offsets.replayed(EVENTS, offset) else ""
        if why:
            return [self._dead(EVENTS, offset, encode_event(ev), f"event: {why}")]
        self._late(offset)
        return []

    def _late(self, offset: int) -> None:
        if self.offsets.replayed(EVENTS, offset):
            self.counts.replayed += 1  # counted (late, or joined) by the run before the restart
        else:
            self.counts.late += 1

    def caught_up(self, inp: int) -> None:
        """The consumer reached the end of this input's partition."""
        self._clocks[inp].caught_up = True

    def _apply(self, rid: str, req: _Request, offset: int, ev: Event) -> list[Emit]:
        assert req.labelled is not None
        why = (f"event: item {ev.item} of a request of {len(req.labelled)} items" if ev.item >= len(req.labelled)
               else f"event: ts {ev.ts:.3f} is {req.ts - ev.ts:.3f} s before its impression's" if ev.ts < req.ts - SKEW_S
               else "")  # fmt: skip
        if why:
            if (EVENTS, offset) in req.held:  # an early event: the dead letter holds it now
                req.held.remove((EVENTS, offset))
            return [self._dead(EVENTS, offset, encode_event(ev), why)]
        after = req.closed or ev.ts > req.deadline  # after the item's first horizon
        if after and (not self.correcting or req.expired or ev.ts > req.ts + self.attribution_s):
            self._late(offset)
            self.offsets.release(EVENTS, offset)
            return []
        if req.labelled[ev.item]:  # re-read after a restart (handled before it), or a second click
            replayed = self.offsets.replayed(EVENTS, offset)
            self.counts.replayed += replayed
            self.counts.duplicates += not replayed
            self.offsets.release(EVENTS, offset)
            return []
        req.labelled[ev.item] = True
        req.held.append((EVENTS, offset))
        self.offsets.hold(EVENTS, offset)
        if after:  # a correction: at the close (the label first), or now from the impression spilled
            if not req.closed:
                req.after.append(ev)
                return []
            return self._correct(rid, req, ev)
        if self.hold_s is not None or req.quarantine or req.defer:  # the sample waits for the close
            req.deferred.append(ev)
            return []
        req.unacked += 1
        self.counts.positives += 1
        assert req.writer is not None  # open: its rows are there
        return [Emit(rid.encode(), [req.writer.labelled(ev)], token=rid)]

    # --- time ----------------------------------------------------------------------------
    def watermark(self, now: float) -> float:
        return self._clocks.watermark(now)

    def advance(self, now: float) -> list[Emit]:
        """Close every window the watermark passed (the negatives of their unlabelled items) and
        count as late the early events whose impression never came within their window."""
        wm = self.watermark(now)
        out: list[Emit] = []
        held_now = self.hold_s is not None  # what closes now closes at the hold's bound: quarantined
        while self._deadlines and self._deadlines[0][0] + (self.hold_s or 0.0) <= wm:
            _, rid = heapq.heappop(self._deadlines)
            req = self.requests[rid]
            req.closed = True
            assert req.writer is not None and req.labelled is not None
            held = held_now or req.quarantine
            negative = ~req.labelled
            negative[[e.item for e in req.after]] = True  # clicked after the horizon: a negative first
            items = np.flatnonzero(negative)
            values = req.writer.closing(req.deferred, items, self.window_s)  # deferred clicks, negatives
            values += [req.writer.labelled(e, CORRECTION) for e in req.after]
            req.unacked += len(values)
            self.counts.negatives += len(items)
            self.counts.positives += len(req.deferred)
            self.counts.corrections += len(req.after)
            self.counts.quarantined += len(values) * held
            if values:
                out.append(Emit(rid.encode(), values, token=rid, quarantine=held))
            req.deferred, req.after = [], []
            if self.correcting:  # what a correction needs of it is read back: the rows go
                req.writer = None
                heapq.heappush(self._attributing, (req.ts + self.attribution_s, rid))
            else:
                req.expired = True
            self._maybe_done(rid, req)
        attributed = self._clocks.attribution(now)
        while self._attributing and self._attributing[0][0] <= attributed:
            _, rid = heapq.heappop(self._attributing)
            req = self.requests[rid]
            req.expired = True
            self._maybe_done(rid, req)
        while self._early and self._early[0][0] <= wm:
            _, offset, rid, ev = heapq.heappop(self._early)
            waiting = self.requests.get(rid)
            if waiting is None or waiting.labelled is not None or all(o != offset for o, _ in waiting.early):
                # its impression came (the event was applied then), or the request it waited for
                # is done and this is another one of the same id (an event after its window)
                continue
            waiting.early = [(o, e) for o, e in waiting.early if o != offset]
            self.waiting -= 1
            self.offsets.release(EVENTS, offset)
            waiting.held.remove((EVENTS, offset))
            out += self._unplaced(offset, ev)
            if not waiting.early:
                del self.requests[rid]
        self.done.expire(wm)
        if self.spill is not None:
            self.spill.expire(attributed)
            self.compact()
        return out

    # --- corrections ---------------------------------------------------------------------
    def _correct(self, rid: str, req: _Request, ev: Event) -> list[Emit]:
        """The correction of a closed request's item, from its impression spilled at its start
        (gone: counted lost)."""
        assert self.spill is not None and req.where is not None
        value = self.spill.get(req.where)
        if value is None:
            self.counts.corrections_lost += 1
            return []
        imp = decode_impression(value)
        writer = SampleWriter(imp, RowTable.of(decode(imp.batch)))
        req.unacked += 1
        req.unjournaled.append(ev.item)
        self.counts.corrections += 1
        self.counts.quarantined += req.quarantine
        return [Emit(rid.encode(), [writer.labelled(ev, CORRECTION)], token=rid, quarantine=req.quarantine)]

    # --- acknowledgements and offsets ----------------------------------------------------
    def acked(self, token: object) -> None:
        self.counts.acked += 1
        if isinstance(token, tuple):  # a dead letter: (input, offset)
            self.offsets.release(*token)
            return
        rid = str(token)
        req = self.requests.get(rid)
        if req is None:  # produced before this partition was lost and assigned again: re-read since
            return
        req.unacked -= 1
        if not req.unacked:  # called for every sample delivered: the rest only at a request's last
            self._maybe_done(rid, req)

    @property
    def open_windows(self) -> int:
        return len(self._deadlines)

    def held_labels(self, now: float, suspect: bool = False) -> tuple[int, int]:
        """(items, items labelled) of the windows past their close the input guard holds
        (``suspect``: of those impressed while it held only)."""
        wm, items, labelled = self.watermark(now), 0, 0
        for deadline, rid in self._deadlines:  # at a clear only: a loop per held request, not per item
            req = self.requests[rid]
            if deadline <= wm and req.labelled is not None and (req.suspect or not suspect):
                items, labelled = items + len(req.labelled), labelled + int(req.labelled.sum())
        return items, labelled

    def release(self, now: float, quarantine: bool) -> list[Emit]:
        """The input guard cleared; the join holds no more. ``quarantine`` (their clicks never
        came): the held windows close now to the quarantine topic, as will the windows still open
        of the impressions read while it held, and for one window after a request's clicks wait for
        the rest of it (the trainer would get a window of clicks and no negative: bench-guard's
        served mean CTR rose from 0.25 to 0.46). Else what a live join would have emitted by now, in
        its order: the held windows' samples and the clicks of those still open (``live_order``)."""
        if not quarantine:
            self.hold_s = None
            return in_live_order(clicks_due(self.requests, self.counts) + self.advance(now))
        for req in self.requests.values():
            req.quarantine = req.quarantine or req.suspect
        self._balance_until = self.watermark(now) + self.window_s
        self.hold_s = 0.0  # what closes now is quarantined
        out, self.hold_s = self.advance(now), None
        return out

    def held_windows(self, now: float) -> int:
        """Windows past their close that the input guard holds open."""
        wm = self.watermark(now)
        return sum(d <= wm for d, _ in self._deadlines) if self.hold_s is not None else 0

    def event_lag(self) -> float:
        """How far the newest event's ts trails the newest impression's (0 before both came)."""
        return self._clocks.event_lag()

    def _maybe_done(self, rid: str, req: _Request) -> None:
        """Every sample of ``req`` so far acknowledged: done once its attribution window is over;
        before, settled in the journal (its records released) when there is one."""
        if req.unacked or not (req.expired or (req.closed and self.journal is not None)):
            return
        if req.expired:
            del self.requests[rid]
            self.done.add(rid, req.ts)
        elif not req.settled:
            assert self.journal is not None
            self.journal.settled(rid, Settled.of(req))
            req.settled = True
        elif req.unjournaled:
            assert self.journal is not None
            self.journal.clicked(rid, req.unjournaled)
        req.unjournaled = []
        for inp, offset in req.held:
            self.offsets.release(inp, offset)
        req.held = []

    def restore(self, settled: dict[str, Settled]) -> None:
        """The requests a run before settled (its journal), before reading from its offsets."""
        for rid, s in settled.items():
            self.requests[rid] = s.request(self.window_s)
            self.done.seen(s.ts)
            heapq.heappush(self._attributing, (s.ts + self.attribution_s, rid))

    def compact(self) -> None:
        """Rewrite the journal with the settled requests once past twice its last size (+16 MB)."""
        if self.journal is not None and self.journal.bytes >= 2 * self._compacted + (16 << 20):
            self.journal.compact(self.requests)
            self._compacted = self.journal.bytes

    if not TYPE_CHECKING:  # (mypy keeps checking every attribute's name)

        def __getattr__(self, name: str) -> object:  # names not found only: refuse the old, naming the new
            moved = {"committable": "offsets.committable()", "read_to": "offsets.next[inp]",
                     "resume": "offsets.replay_to[inp] = read_to"}  # fmt: skip
            if name in moved:
                raise AttributeError(f"PartitionJoin.{name} is now PartitionJoin.{moved[name]} (CHANGELOG.md)")  # fmt: skip
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _dead(self, inp: int, offset: int, value: bytes, reason: str) -> Emit:
        self.counts.malformed[inp] += 1
        self.offsets.hold(inp, offset)
        return Emit(b"", [value], dead=True, reason=reason, token=(inp, offset))
