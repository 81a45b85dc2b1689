"""What ``stream.join`` keeps and returns: its counters (``JoinCounts``), the records it hands the
joiner to produce (``Emit``), a request's state (``_Request``), its inputs' offsets (``Offsets``)
and watermarks (``Clocks``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from stream.records import Event, SampleWriter

IMPRESSIONS, EVENTS = 0, 1
INPUTS = ("impressions", "events")


@dataclass
class JoinCounts:
    """What every partition's join did (the joiner's /metrics read these)."""

    impressions: int = 0
    items: int = 0  # impressed items (the impressions' rows)
    events: int = 0
    positives: int = 0
    negatives: int = 0
    corrections: int = 0  # positives after an item's first horizon, within its attribution window
    corrections_lost: int = 0  # corrections whose impression was no longer spilled (none expected)
    duplicates: int = 0
    late: int = 0
    replayed: int = 0  # events re-read after a restart, handled before it: not late or duplicate again
    replayed_items: int = 0  # items of impressions re-read after a restart, settled before it
    malformed: list[int] = field(default_factory=lambda: [0, 0])  # per input
    acked: int = 0
    quarantined: int = 0  # samples of windows closed while the input guard held them (to quarantine)
    empty_rows: NDArray[np.int64] | None = None  # per slot: impressed rows with no value in it


@dataclass(frozen=True)
class Emit:
    """Records to produce under one key: samples of one request (``dead`` False; a window's close
    emits all of them at once) or a dead letter; ``token`` goes back to ``acked`` once the broker
    has each of them."""

    key: bytes
    values: list[bytes]
    dead: bool = False
    reason: str = ""
    token: object = None
    quarantine: bool = False  # a sample of a window the input guard held to its bound


@dataclass(slots=True)
class _Request:
    deadline: float = float("inf")  # the first horizon's end (event time)
    ts: float = 0.0  # the impression's
    offset: int = -1  # the impression's
    where: tuple[int, int, int] | None = None  # the impression's place in the spill (corrections)
    writer: SampleWriter | None = None  # dropped once the first horizon closes (memory)
    labelled: np.ndarray | None = None  # bool per item: a positive was emitted or is due
    held: list[tuple[int, int]] = field(default_factory=list)  # (input, offset)
    early: list[tuple[int, Event]] = field(default_factory=list)  # events before their impression
    deferred: list[Event] = field(default_factory=list)  # events applied while held: emitted at the close
    after: list[Event] = field(default_factory=list)  # clicks after the first horizon, before its close
    unacked: int = 0
    closed: bool = False
    expired: bool = False  # its attribution window is over: nothing more labels it
    settled: bool = False  # in the journal: its offsets released (``stream.journal``)
    unjournaled: list[int] = field(default_factory=list)  # items corrected since its last journal line
    suspect: bool = False  # impressed while the input guard held the join
    defer: bool = False  # its clicks wait for its window's close (held, or just after a hold)
    quarantine: bool = False  # its samples go to the quarantine topic when its window closes


class Offsets:
    """Per input of a partition's join: the offsets of the records held (one is held until all it
    led to is acknowledged), the next offset to read, and the mark below which the run before a
    restart had read (``replay_to``: an event re-read below it was handled then)."""

    def __init__(self) -> None:
        self.held: tuple[dict[int, None], dict[int, None]] = ({}, {})  # insertion-ordered sets
        self.next = [-1, -1]  # -1: none read yet
        self.replay_to = [0, 0]

    def read(self, inp: int, offset: int) -> None:
        self.next[inp] = offset + 1

    def hold(self, inp: int, offset: int) -> None:
        self.held[inp][offset] = None

    def release(self, inp: int, offset: int) -> None:
        self.held[inp].pop(offset, None)

    def replayed(self, inp: int, offset: int) -> bool:
        return offset < self.replay_to[inp]

    def committable(self) -> tuple[int, int]:
        """Per input, the offset to commit (-1: nothing read yet): the oldest held record's, or
        the next to read when none is held."""
        return tuple(min(h) if h else n for h, n in zip(self.held, self.next, strict=True))  # type: ignore[return-value]


class _Clock:
    """One input's watermark: the newest ts seen; once the input is caught up (read to its end),
    advanced by the wall time since. An input with records still to read stays at its records'
    time: a consumer that lags (a restarted joiner fetching a backlog of impressions, 50 KB each,
    behind its small events) must not see the join's time run past records it has not read yet,
    which would drop a click read first as late, and label its impression negative when it came."""

    def __init__(self) -> None:
        self.ts, self.wall, self.caught_up = float("-inf"), 0.0, False
        self.heard = float("-inf")  # when its last record (of any ts) came, wall time

    def saw(self, ts: float, now: float) -> None:
        if ts >= self.ts:
            self.ts, self.wall = ts, now
        self.caught_up, self.heard = False, now

    def at(self, now: float) -> float:
        return self.ts + max(0.0, now - self.wall) if self.caught_up else self.ts


class Clocks(tuple[_Clock, _Clock]):
    """The two inputs' clocks (``IMPRESSIONS``, ``EVENTS``) and the join's watermarks from them.

    ``events_idle_s``: an events input read to its end holds the watermark at its newest event's
    ts until it has been silent this long. A window's negatives say that no click came by its
    close, which only an event past it shows; without this, a click pipeline that stops while
    impressions flow closes every window as a negative with no positive beside it until the
    input guard trips (bench-guard: 5 s of them moved the served mean CTR by 60%)."""

    idle_s: float

    def __new__(cls, events_idle_s: float = 0.0) -> Clocks:
        clocks = super().__new__(cls, (_Clock(), _Clock()))
        clocks.idle_s = events_idle_s
        return clocks

    def watermark(self, now: float) -> float:
        """The slowest input's watermark among those not caught up (an input never read from is
        at -inf: it holds the join until it delivers or is caught up); when both are caught up,
        the newest, advanced by the wall clock; either way no further than the newest event while
        the events input, caught up, was heard from within ``idle_s``."""
        behind = [c.at(now) for c in self if not c.caught_up]
        wm = min(behind) if behind else max(c.at(now) for c in self)
        ev = self[EVENTS]
        return min(wm, ev.ts) if ev.caught_up and now - ev.heard < self.idle_s else wm

    def attribution(self, now: float) -> float:
        """How far attribution windows may end: the watermark, held back to the events' own clock
        (caught up or not: a producer may write a stretch of impressions before its clicks, and a
        click still in flight within its window counts) once an event came."""
        wm, ev = self.watermark(now), self[EVENTS].at(now)
        return min(wm, ev) if math.isfinite(ev) else wm

    def event_lag(self) -> float:
        """How far the newest event's ts trails the newest impression's (0 before both came)."""
        imp, ev = self[IMPRESSIONS].ts, self[EVENTS].ts
        return max(0.0, imp - ev) if math.isfinite(imp) and math.isfinite(ev) else 0.0
