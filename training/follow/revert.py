"""Rewinding the served version to its last good delta (the output guard's action,
``training.follow.guard``), as the trainer's next delta.

Which delta is good: the newest that served a window the guard judged clearly healthy
(``OutputGuard.good_delta``), and never later than the last cut before the tripping window: the
trainer notes, at each delta it cuts, how many samples it had read (``Cuts``); when the window that
tripped the guard began at sample S, that is the newest cut at or before S (a delta cut before the
trainer started counts as good). Its rows are
the version's dump and its deltas up to it, loaded beside the live tables shard by shard (a second
copy of one shard at a time); every row changed after it (in a later delta, or pending) is written
back or deleted (``serving.ps.rewind``), and the trainer cuts the result as its next delta.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import model_store as ms
from serving.ps.rewind import drop_pending, rewind

log = logging.getLogger("recserve.train.follow")


@dataclass
class Cuts:
    """(delta seq, samples read when it was cut) of the deltas this trainer cut, in order; ``base``
    the version's last delta when it was loaded."""

    base: int = 0
    cut: list[tuple[int, int]] = field(default_factory=list)

    def good(self, since_sample: int) -> int:
        """The newest delta cut at or before sample ``since_sample`` was read."""
        return max([self.base, *(seq for seq, seen in self.cut if seen <= since_sample)])


@dataclass(frozen=True)
class Reverted:
    to: int  # the delta the rows are back at
    deltas: int  # the deltas undone
    rows: int  # rows written back
    deleted: int  # rows that delta did not have, deleted


def revert(vdir: Path, stores: list, to: int) -> Reverted:
    """Rewind ``stores`` (the live embedded ``TableShard``s of the version at ``vdir``) to delta
    ``to``: pending for the next delta, which the caller cuts."""
    last = stores[0].delta_seq
    later = [seq for seq in ms.list_deltas(vdir) if to < seq <= last]
    rows = deleted = 0
    for store in stores:
        touched = [drop_pending(store)]
        for seq in later:
            d = store.read(ms.delta_dir(vdir, seq), delta=True)
            touched += [d.signs, d.deleted]
        good = store.staging()
        good.load(vdir / "embeddings")
        for seq in ms.list_deltas(vdir, after=good.delta_seq):
            if seq > to:
                break
            good.apply_delta(ms.delta_dir(vdir, seq))
        w, g = rewind(store, good.snapshot(copy=False), np.concatenate(touched))
        rows, deleted = rows + w, deleted + g
        del good
    log.warning("rewound %s to delta %d: %d deltas undone, %d rows written back, %d deleted",
                vdir.name, to, len(later), rows, deleted)  # fmt: skip
    return Reverted(to, len(later), rows, deleted)


class Rewinder:
    """The trainer's side of the output guard: the deltas it cut (``Cuts``), the rewind when the
    guard trips, and the guard's metrics."""

    def __init__(self, guard, registry=None, model_dir: Path | None = None) -> None:
        self.guard, self.cuts, self.rewinds = guard, Cuts(), 0
        self.held = 0  # samples read and not trained while the guard held
        self.last: Reverted | None = None
        self._due = self._rewound = False
        self.model_dir, self.version = model_dir, ""  # the guard log's (model_store.guards)
        if registry is not None:
            registry.register(_Collector(self))

    def loaded(self, version: str, base: int) -> None:
        """``version`` was loaded with its deltas up to ``base``."""
        self.cuts, self.version = Cuts(base), version
        self.guard.new_version()

    def cut(self, seq: int) -> None:
        self.cuts.cut.append((seq, self.guard.seen))
        if self._rewound and self.last is not None:
            self._rewound = False
            self.guard.rewound(seq)
            self._record("rewind", delta=seq, to=self.last.to)

    def judge(self, scores, labels, requests=None, deltas=None) -> bool:
        """Feed a step's served scores, labels, request ids and the deltas that served them; True:
        train it (the guard does not hold)."""
        reason = self.guard.reason
        event = self.guard.saw(scores, labels, requests, deltas)
        if event:
            self._record(event, reason=self.guard.reason or f"cleared ({reason})")
        if event == "trip":
            self._due = True
        if self.guard.tripped:
            self.held += len(labels)
        return not self.guard.tripped

    def target(self) -> int:
        """The last good delta: the newest that served a clearly healthy window, and no later than
        the last cut before the tripping window began."""
        to = self.cuts.good(self.guard.since_sample)
        return to if self.guard.good_delta is None else max(0, min(to, self.guard.good_delta))

    def rewind(self, vdir: Path, stores: list, settle: Callable[[], None] = lambda: None) -> bool:
        """After a trip: the stores rewound to the last good delta (the caller cuts it), once
        ``settle`` published the delta in flight (the rewind reads the published ones); False when
        nothing is due."""
        if not self._due:
            return False
        self._due = False
        settle()
        self.last = revert(vdir, stores, self.target())
        self.rewinds += 1
        self._rewound = True
        return True

    def _record(self, event: str, **kw) -> None:
        from model_store.guards import GuardEvent, record_or_log

        if self.model_dir is not None:
            record_or_log(self.model_dir, GuardEvent("output", event, version=self.version, **kw))


class _Collector:
    def __init__(self, r: Rewinder) -> None:
        self.r = r

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        r, g = self.r, self.r.guard
        nan = float("nan")
        yield GaugeMetricFamily("recserve_follow_guard_tripped", "1 while the output guard holds training", value=float(g.tripped))  # fmt: skip
        yield CounterMetricFamily("recserve_follow_guard_trips", "Output guard trips", value=g.trips)
        yield CounterMetricFamily("recserve_follow_guard_recoveries", "Output guard trips that cleared", value=g.recoveries)  # fmt: skip
        yield CounterMetricFamily("recserve_follow_guard_rewinds", "Rewinds of the served rows to the last good delta", value=r.rewinds)  # fmt: skip
        yield CounterMetricFamily("recserve_follow_guard_held_samples", "Samples read and not trained while the guard held", value=r.held)  # fmt: skip
        last = g.last
        yield GaugeMetricFamily("recserve_follow_served_auc", "AUC of the served scores over the last judged window", value=nan if last is None else last.auc)  # fmt: skip
        yield GaugeMetricFamily("recserve_follow_served_calibration", "Mean served score over click rate, last judged window", value=nan if last is None else last.calibration)  # fmt: skip
