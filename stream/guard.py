"""The joiner's input guard: is what enters the loop healthy enough to learn from?

Measured where the data enters (the joiner), from what it reads, in one-second buckets of
arrival (wall) time:

- **label rate**: events per impressed item over the last ``window_s``, against its own band (the
  same ratio over the last ``band_s`` healthy seconds before that window). A pipeline that stops
  delivering clicks while impressions flow makes it fall; ``low`` x the band trips the guard. A
  burst above the band is no trip: that is what delayed clicks look like when they arrive at last.
- **event lag**, per partition: how far the newest event's ts trails the newest impression's
  (events are produced after the impressions they follow, so a lag of seconds is normal); over
  ``max_lag_s`` trips, once the partition impressed ``min_items`` items in the window.
- **empty slots**: a feature slot that holds no value in (nearly) every row of the window where its
  band had values: an upstream feature job that died. Trips when a slot's empty share rises by
  more than ``max_empty_rise`` over its band's.

Nothing is judged before the band has seen ``warmup_items`` healthy items, nor over a window of
fewer than ``min_items``; a second not judged leaves the guard as it was: healthy stays healthy, a
trip holds. The guard clears only when a judged window has every measure back (the label rate at
``clear`` x the band or above); ``cleared`` says which measure came back, and after how long. A
second judged under a trip never enters the band, and the band counts healthy seconds, not wall
time: however long a trip lasts, it is judged against the last healthy band, so an outage longer
than ``band_s`` neither empties the band nor becomes it.

While the guard is tripped the join holds its windows open (up to ``hold_s`` past their close, so
that clicks that come late still label right) and emits nothing from them; windows that reach the
bound go to the quarantine topic, counted, replayable by ``recserve join --replay-quarantine``
once judged good (``stream.joiner``). The trainer, fed nothing from the outage, cuts no delta from
it. Each trip and recovery is counted on /metrics (``recserve_join_guard_*``) and logged.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

log = logging.getLogger("recserve.join")


@dataclass
class GuardConfig:
    """The input guard's thresholds (each a ``recserve join`` flag; the defaults are documented in
    docs/guards-and-experiments.md)."""

    enabled: bool = field(default=True, metadata={"flag": "input-guard"})
    """Judge the input and hold windows while it is unhealthy (--no-input-guard: never)."""
    window_s: float = field(default=5.0, metadata={"flag": "guard-window-s"})
    """The trailing arrival time each measure is judged over."""
    band_s: float = field(default=300.0, metadata={"flag": "guard-band-s"})
    """The healthy seconds (before the window) the band each measure is judged against holds; a
    second judged under a trip is not one, so a trip never ages the band out."""
    low: float = field(default=0.25, metadata={"flag": "guard-low"})
    """Trip when the window's label rate falls under this share of the band's."""
    clear: float = field(default=0.5, metadata={"flag": "guard-clear"})
    """Clear (label rate) once the window's is back at this share of the band's or above."""
    max_lag_s: float = field(default=30.0, metadata={"flag": "guard-max-lag-s"})
    """Trip when a partition's newest event trails its newest impression by more than this."""
    max_empty_rise: float = field(default=0.5, metadata={"flag": "guard-max-empty-rise"})
    """Trip when a slot's share of empty rows in the window exceeds its band's by more than this."""
    min_items: int = field(default=500, metadata={"flag": "guard-min-items"})
    """Items a window (or a partition's window, for the lag) must hold to be judged."""
    warmup_items: int = field(default=5000, metadata={"flag": "guard-warmup-items"})
    """Healthy items the band must hold before anything is judged."""
    hold_s: float = field(default=120.0, metadata={"flag": "guard-hold-s"})
    """How long past its close a window is held open while the guard is tripped; then its samples
    go to the quarantine topic."""

    def __post_init__(self) -> None:
        if not (0 < self.window_s < self.band_s):
            raise ValueError(
                f"guard window_s must be > 0 and under band_s, got {self.window_s}, {self.band_s}"
            )
        if not (0 <= self.low <= self.clear <= 1):
            raise ValueError(f"guard thresholds need 0 <= low <= clear <= 1, got {self.low}, {self.clear}")
        if self.max_lag_s <= 0 or self.hold_s < 0 or not (0 < self.max_empty_rise <= 1):
            raise ValueError("guard max_lag_s must be > 0, hold_s >= 0 and max_empty_rise in (0, 1]")


@dataclass
class _Bucket:
    second: int
    items: int = 0
    events: int = 0
    empty: NDArray[np.int64] | None = None  # per slot: rows with no value
    healthy: bool = True


@dataclass(frozen=True)
class Trip:
    """Why the guard is tripped: the measure (label_rate, event_lag, empty_slot) and the figures."""

    measure: str
    reason: str


class InputGuard:
    """Judges the input each second from what the joiner counted (``saw``, ``judge``)."""

    MEASURES = ("label_rate", "event_lag", "empty_slot")

    def __init__(self, cfg: GuardConfig) -> None:
        self.cfg = cfg
        self._buckets: deque[_Bucket] = deque()
        self.trip: Trip | None = None
        self.since = 0.0  # when the current trip began (wall time)
        self.cleared = ""  # why the last trip cleared
        self.trips = dict.fromkeys(self.MEASURES, 0)
        self.recoveries = 0
        self.tripped_s = 0.0  # time spent tripped, over the run (trips that ended)
        self.rate = self.band = math.nan  # the last judged window's and band's label rates
        self.items = self.events = 0  # all it was told of
        self._impressed: deque[tuple[float, dict[int, int]]] = deque()  # (when, items per partition)

    @property
    def tripped(self) -> bool:
        return self.trip is not None

    def saw(
        self, now: float, items: int = 0, events: int = 0, empty: NDArray[np.int64] | None = None
    ) -> None:
        """Count ``items`` impressed, ``events`` read and per slot the rows with no value
        (``empty``) at ``now``."""
        b = self._bucket(now)
        b.items += items
        b.events += events
        self.items, self.events = self.items + items, self.events + events
        if empty is not None:
            b.empty = empty.astype(np.int64) if b.empty is None else b.empty + empty

    def judge(self, now: float, partitions: dict[int, tuple[float, int]]) -> Trip | None:
        """Trip or clear from the buckets and each partition's (event lag, items impressed so
        far); returns the trip in force (None: healthy). A window too thin to judge, or a band
        too young, changes nothing."""
        c = self.cfg
        self._bucket(now)
        cut = int(now - c.window_s)  # the window: the last window_s seconds and this one so far
        self._impressed.append((now, {p: n for p, (_, n) in partitions.items()}))
        while self._impressed[0][0] < now - c.window_s:
            self._impressed.popleft()
        first = self._impressed[0][1]
        lags = {p: (lag, n - first.get(p, 0)) for p, (lag, n) in partitions.items()}
        window, band = self._expire(cut)
        items, band_items = sum(b.items for b in window), sum(b.items for b in band)
        if band_items >= c.warmup_items:
            self.rate = sum(b.events for b in window) / items if items else math.nan
            self.band = sum(b.events for b in band) / band_items
            if items >= c.min_items:
                self._change(now, self._measure(window, band, items, band_items, lags))
        if self.trip is not None:  # nothing measured under a trip becomes the band
            for b in window:
                b.healthy = False
        return self.trip

    def _change(self, now: float, trip: Trip | None) -> None:
        """Trip, clear or carry on, from what a judged window measured."""
        if trip is not None and self.trip is None:
            self.trip, self.since = trip, now
            self.trips[trip.measure] += 1
            log.warning("input guard tripped: %s (windows held up to %gs, then quarantined)", trip.reason, self.cfg.hold_s)  # fmt: skip
        elif trip is None and self.trip is not None:
            self.recoveries += 1
            self.tripped_s += now - self.since
            self.cleared = self._why_clear(self.trip, now)
            log.warning("input guard cleared: %s", self.cleared)
            self.trip = None
        elif trip is not None:
            self.trip = trip

    def _measure(self, window: list[_Bucket], band: list[_Bucket], items: int, band_items: int, lags: dict[int, tuple[float, int]]) -> Trip | None:  # fmt: skip
        """The trip a judged window (``min_items`` and more, its band warm) measures, or None."""
        c = self.cfg
        if self.band > 0:
            bar = c.clear if self.trip is not None and self.trip.measure == "label_rate" else c.low
            if self.rate < bar * self.band:
                return Trip("label_rate", f"label rate {self.rate:.4f} over the last {c.window_s:g}s ({items} items) is under {bar:g} x its band {self.band:.4f}")  # fmt: skip
        for p, (lag, n) in sorted(lags.items()):
            if n >= c.min_items and lag > c.max_lag_s:
                return Trip("event_lag", f"partition {p}'s newest event trails its newest impression by {lag:.1f}s (over {c.max_lag_s:g}s)")  # fmt: skip
        return self._empty_slot(window, band, items, band_items)

    def _why_clear(self, trip: Trip, now: float) -> str:
        """Why ``trip`` clears at ``now``: its measure is back in a judged window."""
        c, after = self.cfg, f"after {now - self.since:.1f}s"
        return {
            "label_rate": f"label rate {self.rate:.4f} over the last {c.window_s:g}s is back at >= {c.clear:g} x its band {self.band:.4f} {after}",
            "event_lag": f"no partition's newest event trails its newest impression by more than {c.max_lag_s:g}s {after}",
            "empty_slot": f"no slot's share of empty rows is more than {c.max_empty_rise:g} over its band's {after}",
        }[trip.measure]  # fmt: skip

    def _empty_slot(self, window: list[_Bucket], band: list[_Bucket], items: int, band_items: int) -> Trip | None:  # fmt: skip
        empties = [b.empty for b in window if b.empty is not None]
        before = [b.empty for b in band if b.empty is not None]
        if not empties or not before:
            return None
        share = np.sum(empties, axis=0) / items
        base = np.sum(before, axis=0) / band_items
        if share.shape != base.shape:
            return None  # the schema changed: a new band forms
        rise = share - base
        worst = int(np.argmax(rise))
        if rise[worst] > self.cfg.max_empty_rise:
            return Trip("empty_slot", f"slot {worst} is empty in {share[worst]:.0%} of the last {self.cfg.window_s:g}s' rows, {base[worst]:.0%} in its band")  # fmt: skip
        return None

    def _bucket(self, now: float) -> _Bucket:
        second = int(now)
        if not self._buckets or self._buckets[-1].second < second:
            self._buckets.append(_Bucket(second))
        return self._buckets[-1]

    def _expire(self, cut: int) -> tuple[list[_Bucket], list[_Bucket]]:
        """The window (the buckets from ``cut`` on) and the band (the last ``band_s`` healthy
        buckets before it); every other bucket is dropped. The band is counted in healthy
        seconds, not wall time, so that a trip, however long, leaves it the last healthy band."""
        window = [b for b in self._buckets if b.second >= cut]
        healthy = [b for b in self._buckets if b.second < cut and b.healthy]
        band = healthy[max(0, len(healthy) - math.ceil(self.cfg.band_s)) :]
        self._buckets = deque([*band, *window])
        return window, band
