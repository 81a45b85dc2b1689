"""The streaming trainer's output guard: is what serving scores still right?

Judged from the joined stream, on what the served model predicted (each sample carries the score
it was served with, ``stream.records``): over windows of ``window`` samples of whole requests (a
request's clicks, read as they came, with the rest of its items, read when its join window closed),
the served AUC and the calibration (mean predicted over observed click rate).
Healthy windows form the band (the last ``band_windows``); a window whose AUC falls more than
``max_auc_drop`` under the band's median, or whose calibration leaves ``[1/max_calibration_ratio,
max_calibration_ratio]`` x the band's, trips the guard, once the band holds ``min_band_windows``.

A trip (``training.follow.trainer``): the trainer trains nothing more while it holds (the samples
are counted, not trained), cuts no rows, and rewinds the served version's rows to the last good
delta (``training.follow.revert``): a delta like any other, so every serving process on every host
applies it at its notice or poll. The last good delta is the newest that served a window *clearly*
healthy, within half the trip's bounds (``good_delta``; each sample names the delta that served
it), and never later than the last cut before the tripping window began. A poison the model learns
as fast as it comes (bench-guard's inverted clicks, trained at once, a join window before their
requests' negatives) keeps the windows of the bad stretch just inside the bounds, a model trained
on them agreeing with their labels; it trips only once that model serves good labels, and the
delta cut before that window already holds the poison.

It clears when ``clear_windows`` windows in a row are back within the same bounds, each of samples
all read after the trip and served by the rewound rows or later (``served_from``): a window served
by the model that tripped, its labels of the same stretch, looks healthy (bench-guard's inverted
labels cleared it so, and the trainer then trained the stretch's remaining negatives). Training
then resumes from the rewound rows.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from stream.arms import auc

log = logging.getLogger("recserve.train.follow")


@dataclass
class OutputGuardConfig:
    """The output guard's thresholds (``recserve train --follow`` flags; defaults in
    docs/guards-and-experiments.md)."""

    enabled: bool = field(default=True, metadata={"flag": "output-guard"})
    """Judge the served scores of the samples read; on a trip, train nothing and rewind the
    served rows to the last good delta (--no-output-guard: never)."""
    window: int = field(default=2000, metadata={"flag": "guard-window-samples"})
    """Samples a judged window holds."""
    band_windows: int = field(default=10, metadata={"flag": "guard-band-windows"})
    """Healthy windows the band keeps."""
    min_band_windows: int = field(default=3, metadata={"flag": "guard-min-band-windows"})
    """Healthy windows the band needs before anything is judged."""
    max_auc_drop: float = field(default=0.2, metadata={"flag": "guard-max-auc-drop"})
    """Trip when a window's served AUC falls this far under the band's median (a drifting world
    moves it by 0.1 in a minute: bench-guard)."""
    max_calibration_ratio: float = field(default=3.0, metadata={"flag": "guard-max-calibration-ratio"})
    """Trip when a window's calibration is more than this many times the band's, or under its
    inverse (the clicks of an outage, delivered late, move it by 2x: bench-guard), unless it is
    nearer 1 than the band's: a model that over-predicted 4x as it started and learns the rate
    tripped the guard so (bench-guard on c8b2f00)."""
    warmup_windows: int = field(default=5, metadata={"flag": "guard-warmup-windows"})
    """Windows read at the start that neither judge nor join the band: a stream's first samples
    are a join window's clicks before their requests' negatives."""
    clear_windows: int = field(default=2, metadata={"flag": "guard-clear-windows"})
    """Healthy windows in a row that clear a trip."""
    idle_reset_s: float = field(default=30.0, metadata={"flag": "guard-idle-reset-s"})
    """After this long with no sample read (the joiner's input guard held the join, the stream
    stopped), the band forms anew, warmup first: the served model learnt nothing meanwhile, and in
    a drifting world a band of before would trip on its staleness alone (bench-guard: served AUC
    0.57 against a band of 0.78 after 90 s held, then rewound, and never clear). 0: never."""

    def __post_init__(self) -> None:
        if self.clear_windows < 1 or self.warmup_windows < 0 or self.idle_reset_s < 0:
            raise ValueError("output guard: clear_windows >= 1, warmup_windows >= 0 and idle_reset_s >= 0")
        if self.window < 100 or self.band_windows < 1 or not 1 <= self.min_band_windows <= self.band_windows:
            raise ValueError("output guard: window >= 100 samples, 1 <= min_band_windows <= band_windows")
        if not 0 < self.max_auc_drop < 1 or self.max_calibration_ratio <= 1:
            raise ValueError("output guard: max_auc_drop in (0, 1) and max_calibration_ratio > 1")


@dataclass(frozen=True)
class Judged:
    auc: float  # NaN: the window held one label only
    calibration: float  # NaN: no click in the window


class OutputGuard:
    """Fed the served scores and labels of each step (``saw``); ``tripped`` while it holds."""

    def __init__(self, cfg: OutputGuardConfig) -> None:
        self.cfg = cfg
        self.seen = 0  # samples fed so far
        self._scores: list[NDArray[np.float64]] = []
        self._labels: list[NDArray[np.float64]] = []
        self._first = 0  # the first sample (by ``seen``) of the current window
        self._deltas: list[NDArray[np.int64]] = []
        self._pending: tuple[NDArray, ...] = (
            np.zeros(0, "S1"),
            np.zeros(0),
            np.zeros(0),
            np.zeros(0, np.int64),
            np.zeros(0, np.int64),
        )  # clicks of open requests: request ids, scores, labels, read positions, serving deltas
        self.band: deque[Judged] = deque(maxlen=cfg.band_windows)
        self.last: Judged | None = None
        self.reason = ""
        self.since_sample = -1  # where the window that tripped began (-1: not tripped)
        self.trips = self.recoveries = self.judged = self.resets = 0
        self._healthy = 0  # healthy windows in a row while tripped
        self._warm_from = 0  # ``judged`` when the band last started forming (warmup counts from it)
        self._trip_seen = 0  # samples fed when it last tripped: only windows read wholly after clear it
        self.good_delta: int | None = None  # the newest delta seen serving a clearly healthy window
        self.served_from: int | None = None  # while tripped: only windows served from this delta clear it
        self.clock = time.monotonic
        self._read_at: float | None = None  # when the last sample was read

    @property
    def tripped(self) -> bool:
        return self.since_sample >= 0

    def saw(self, scores: NDArray[np.floating], labels: NDArray[np.floating],
            requests: NDArray[np.bytes_] | None = None, deltas: NDArray[np.integer] | None = None) -> str:  # fmt: skip
        """Feed a step's samples (in the order read; ``requests``: each one's request id, to judge
        whole requests; ``deltas``: the delta that served each, -1 or None: not known); "trip" or
        "clear" when the guard changed state, else ""."""
        self._idle(len(scores))
        at = np.arange(self.seen, self.seen + len(scores))
        s, y = np.asarray(scores, np.float64), np.asarray(labels, np.float64)
        d = np.full(len(s), -1, np.int64) if deltas is None else np.asarray(deltas, np.int64)
        self.seen += len(scores)
        if requests is not None:
            s, y, at, d = self._whole(s, y, at, d, np.asarray(requests))
        self._scores.append(s)
        self._labels.append(y)
        self._deltas.append(d)
        self._first = min(self._first, int(at.min(initial=self.seen)))
        if sum(map(len, self._scores)) < self.cfg.window:
            return ""
        s, y, d = np.concatenate(self._scores), np.concatenate(self._labels), np.concatenate(self._deltas)
        self._scores, self._labels, self._deltas, start, self._first = [], [], [], self._first, self.seen
        calibration = float(s.mean() / y.mean()) if y.sum() > 0 else math.inf if s.mean() > 0 else math.nan
        judged = Judged(auc(s, y) if 0 < y.sum() < len(y) else math.nan, calibration)  # no click: inf
        self.last = judged
        self.judged += 1
        if self.judged - self._warm_from <= self.cfg.warmup_windows:
            return ""
        why = self._judge(judged)
        known = d[d >= 0]
        if not why and not self.tripped and known.size and not self._judge(judged, slack=0.5):
            self.good_delta = int(known.max())
        if why:
            self._healthy = 0
        if why and not self.tripped:
            self.since_sample, self.reason, self._trip_seen = start, why, self.seen
            self.trips += 1
            log.warning("output guard tripped: %s", why)
            return "trip"
        if not why and self.tripped:
            if start < self._trip_seen:  # of requests read (served) before the trip: they do not clear it
                return ""
            if self.served_from is not None and known.min(initial=self.served_from) < self.served_from:
                return ""  # served (in part) before the rewind: the model that tripped judged
            self._healthy += 1
            if self._healthy < self.cfg.clear_windows:
                return ""
            log.warning(
                "output guard cleared: served AUC %.4f, calibration %.3f", judged.auc, judged.calibration
            )
            self.since_sample, self.reason, self.served_from = -1, "", None
            self.recoveries += 1
            return "clear"
        if not why:
            self.band.append(judged)
        return ""

    def rewound(self, seq: int) -> None:
        """The rewind was cut as delta ``seq``: while tripped, only windows served from it clear."""
        if self.tripped:
            self.served_from = seq

    def new_version(self) -> None:
        """Another version was loaded: the deltas seen serving were another version's."""
        self.good_delta = self.served_from = None

    def _idle(self, samples: int) -> None:
        """A long stretch with nothing read before these ``samples``: the band starts over."""
        if not samples:
            return
        now, last = self.clock(), self._read_at
        self._read_at = now
        if (
            self.cfg.idle_reset_s
            and last is not None
            and now - last >= self.cfg.idle_reset_s
            and not self.tripped
        ):
            self.band.clear()
            self._warm_from, self.resets = self.judged, self.resets + 1
            log.warning("output guard: nothing read for %.0f s, its band forms anew", now - last)

    def _whole(self, s, y, at, d, requests) -> tuple[NDArray[np.float64], NDArray[np.float64], NDArray[np.int64], NDArray[np.int64]]:  # fmt: skip
        """The samples of the requests whose negatives came in this step, with the clicks of those
        requests read earlier (kept until then: the join emits a click at once and the rest of its
        request when the window closes). A window of arrivals would compare clicks with other,
        older requests' negatives; whole requests compare items served together."""
        neg = y == 0
        done = np.unique(requests[neg])
        pending = [np.concatenate([a, b[~neg]]) for a, b in zip(self._pending, (requests, s, y, at, d), strict=True)]  # fmt: skip
        hit = np.isin(pending[0], done)
        keep = np.flatnonzero(~hit)[-self.cfg.window * 10 :]  # clicks of requests still open, bounded
        self._pending = tuple(p[keep] for p in pending)
        ps, py, pa, pd = (p[hit] for p in pending[1:])
        return (np.concatenate([ps, s[neg]]), np.concatenate([py, y[neg]]), np.concatenate([pa, at[neg]]),
                np.concatenate([pd, d[neg]]))  # fmt: skip

    def _judge(self, w: Judged, slack: float = 1.0) -> str:
        """Why the window ``w`` is unhealthy ('' : it is, or there is no band yet); ``slack`` < 1:
        within that share of the bounds (the calibration's in log space)."""
        c = self.cfg
        if len(self.band) < c.min_band_windows:
            return ""
        drop, most = c.max_auc_drop * slack, c.max_calibration_ratio**slack
        aucs = [b.auc for b in self.band if not math.isnan(b.auc)]
        if aucs and not math.isnan(w.auc) and w.auc < statistics.median(aucs) - drop:
            return f"served AUC {w.auc:.4f} over {c.window} samples is more than {drop:g} under its band's {statistics.median(aucs):.4f}"  # fmt: skip
        cals = [b.calibration for b in self.band if not math.isnan(b.calibration)]
        if cals and statistics.median(cals) > 0 and not math.isnan(w.calibration) and w.calibration > 0:
            ratio = w.calibration / statistics.median(cals)
            nearer = abs(math.log(w.calibration)) <= abs(math.log(statistics.median(cals)))
            if not nearer and not 1 / most <= ratio <= most:  # a model coming to 1 is no trip
                return f"served calibration {w.calibration:.3f} is {ratio:.2f} x its band's {statistics.median(cals):.3f}"  # fmt: skip
        return ""
