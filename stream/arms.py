"""Online metrics per experiment arm, from the joined samples (issue 56, part 4).

A sample is one served (request, item): its arm, the served predicted click rate ``score``, its
``label`` (0 or 1) and its event time ``ts`` (seconds), optionally the request id. Per arm:

- impressions (distinct request ids when given, else samples), samples, clicks;
- CTR (clicks / samples) and the mean predicted CTR, each with a normal-approximation interval;
- calibration = mean predicted / observed CTR, its interval by the delta method (NaN without clicks);
- log loss: the mean binary cross-entropy of the score clipped to [1e-7, 1 - 1e-7], with interval;
- AUC: Mann-Whitney over average ranks (ties count one half, as scikit-learn's ``roc_auc_score``),
  its interval by Hanley and McNeil (1982); NaN unless both labels are present.

``arm_metrics`` computes them from whole arrays in one go, the recomputation every published figure
must equal; ``ArmsAccumulator`` takes the samples chunk by chunk, as the metrics role consumes them,
and reports each arm cumulatively (since the experiment's start) and over the last ``window_s``
seconds of event time (the newest ``ts`` seen so far minus ``window_s``, inclusive). Sums are float64
in arrival order, so the two agree to rounding (far below 1e-9). The accumulator keeps each arm's
samples (25 bytes a sample) because the AUC and the window need them; ``ArmSums``, what the
sequential rule reads, are running sums of O(1) size.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
from numpy.typing import ArrayLike, NDArray

from features.hashing import xxh64_strings

EPS = 1e-7
"""Scores are clipped to [EPS, 1 - EPS] in the log loss (as ``training.evaluate.logloss``)."""
LEVEL = 0.95
"""Default coverage of the confidence intervals."""

F64 = NDArray[np.float64]


@dataclass(frozen=True)
class Samples:
    """Joined samples, validated: equal lengths, finite scores in [0, 1], labels 0 or 1, finite ts."""

    arm: NDArray[np.generic]
    score: F64
    label: F64
    ts: F64
    request: NDArray[np.uint64] | None = None
    """Request ids hashed to uint64 (XXH64 of the string), or None: an impression per sample."""

    @classmethod
    def of(
        cls,
        arm: ArrayLike,
        score: ArrayLike,
        label: ArrayLike,
        ts: ArrayLike | None = None,
        request: ArrayLike | None = None,
    ) -> Samples:
        """Check and convert; ValueError naming the problem. ``ts`` None: all at time 0."""
        a = np.asarray(arm).ravel()
        s = np.asarray(score, dtype=np.float64).ravel()
        y = np.asarray(label, dtype=np.float64).ravel()
        t = np.zeros(len(a)) if ts is None else np.asarray(ts, dtype=np.float64).ravel()
        lengths = {"arm": len(a), "score": len(s), "label": len(y), "ts": len(t)}
        r = None
        if request is not None:
            r = request_hashes(request)
            lengths["request"] = len(r)
        if len(set(lengths.values())) > 1:
            raise ValueError(f"arrays of different lengths: {lengths}")
        check_scores(s, y)
        if not np.all(np.isfinite(t)):
            raise ValueError(f"{int((~np.isfinite(t)).sum())} ts are not finite")
        return cls(a, s, y, t, r)

    def take(self, mask: NDArray[np.bool_]) -> Samples:
        r = None if self.request is None else self.request[mask]
        return Samples(self.arm[mask], self.score[mask], self.label[mask], self.ts[mask], r)


def check_scores(score: F64, label: F64) -> None:
    """ValueError unless every score is a finite probability and every label 0 or 1."""
    if len(score) != len(label):
        raise ValueError(f"{len(score)} scores but {len(label)} labels")
    bad = ~np.isfinite(score)
    if bad.any():
        raise ValueError(f"{int(bad.sum())} scores are NaN or infinite (first at index {np.argmax(bad)})")
    if len(score) and (score.min() < 0 or score.max() > 1):
        raise ValueError(f"scores must be probabilities in [0, 1], got {score.min()}..{score.max()}")
    off = (label != 0) & (label != 1)
    if off.any():
        raise ValueError(f"labels must be 0 or 1, got {np.unique(label[off])[:5]}")


def request_hashes(request: ArrayLike) -> NDArray[np.uint64]:
    """uint64 ids: unsigned integers as they are, strings by XXH64 (seed 0)."""
    r = np.asarray(request).ravel()
    if r.dtype.kind == "u":
        return r.astype(np.uint64)
    if r.dtype.kind in "US":
        return xxh64_strings(r.astype(np.str_), seed=0)
    raise ValueError(f"request ids must be strings or unsigned integers, got dtype {r.dtype}")


def sample_logloss(score: F64, label: F64) -> F64:
    """Per-sample binary cross-entropy of the clipped score against the label (nats)."""
    p = np.clip(score, EPS, 1 - EPS)
    return -(label * np.log(p) + (1 - label) * np.log1p(-p))


@dataclass(frozen=True)
class ArmSums:
    """One arm's running sums: what the sequential rule and the calibration guardrail read."""

    n: int = 0
    clicks: float = 0.0
    score_sum: float = 0.0
    loss_sum: float = 0.0
    loss_sq_sum: float = 0.0

    @classmethod
    def of(cls, score: F64, label: F64) -> ArmSums:
        """The sums of one arm's samples (checked)."""
        check_scores(score, label)
        loss = sample_logloss(score, label)
        return cls(len(score), float(label.sum()), float(score.sum()), float(loss.sum()), float(loss @ loss))

    def __add__(self, other: ArmSums) -> ArmSums:
        return ArmSums(
            self.n + other.n,
            self.clicks + other.clicks,
            self.score_sum + other.score_sum,
            self.loss_sum + other.loss_sum,
            self.loss_sq_sum + other.loss_sq_sum,
        )

    @property
    def calibration(self) -> float:
        """Mean predicted / observed CTR (NaN without clicks)."""
        return self.score_sum / self.clicks if self.clicks > 0 else float("nan")


@dataclass(frozen=True)
class Estimate:
    """A figure and its confidence interval (NaN bounds where none is meaningful)."""

    value: float
    low: float = float("nan")
    high: float = float("nan")


@dataclass(frozen=True)
class ArmMetrics:
    """One arm's metrics over some set of samples."""

    impressions: int
    samples: int
    clicks: int
    ctr: Estimate
    mean_predicted: Estimate
    calibration: Estimate
    logloss: Estimate
    auc: Estimate


@dataclass(frozen=True)
class ArmReport:
    """One arm, cumulatively and over the sliding window."""

    arm: object
    cumulative: ArmMetrics
    window: ArmMetrics


def auc(score: F64, label: F64) -> float:
    """Mann-Whitney AUC over average ranks (ties one half); NaN unless both labels occur."""
    n_pos = int(label.sum())
    n_neg = len(label) - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(score, kind="stable")
    ranked = score[order]
    starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
    ends = np.r_[starts[1:], len(ranked)]
    ranks = np.repeat((starts + ends + 1) / 2.0, ends - starts)
    u = ranks[label[order] == 1].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def _z(level: float) -> float:
    return NormalDist().inv_cdf(0.5 + level / 2)


def _mean(total: float, total_sq: float, n: int, z: float) -> Estimate:
    if n == 0:
        return Estimate(float("nan"))
    m = total / n
    if n < 2:
        return Estimate(m)
    half = z * float(np.sqrt(max(total_sq - total * m, 0.0) / (n - 1) / n))
    return Estimate(m, m - half, m + half)


def _calibration(s: F64, y: F64, z: float) -> Estimate:
    n, clicks = len(s), float(y.sum())
    if clicks == 0 or n < 2:
        return Estimate(float("nan"))
    ps, py = float(s.mean()), clicks / n
    r = ps / py
    cov = np.cov(s, y)  # delta method for a ratio of two means of the same samples
    var = float(r * r * (cov[0, 0] / ps**2 + cov[1, 1] / py**2 - 2 * cov[0, 1] / (ps * py)) / n)
    half = z * float(np.sqrt(max(var, 0.0)))
    return Estimate(r, r - half, r + half)


def _auc(s: F64, y: F64, z: float) -> Estimate:
    a = auc(s, y)
    if np.isnan(a):
        return Estimate(a)
    n_pos, n_neg = float(y.sum()), len(y) - float(y.sum())
    q1, q2 = a / (2 - a), 2 * a * a / (1 + a)
    se = np.sqrt(
        max(a * (1 - a) + (n_pos - 1) * (q1 - a * a) + (n_neg - 1) * (q2 - a * a), 0.0) / (n_pos * n_neg)
    )
    return Estimate(a, max(a - z * float(se), 0.0), min(a + z * float(se), 1.0))


def one_arm(score: F64, label: F64, request: NDArray[np.uint64] | None, level: float = LEVEL) -> ArmMetrics:
    """The metrics of one arm's samples (already checked)."""
    z = _z(level)
    n = len(score)
    clicks = float(label.sum())
    loss = sample_logloss(score, label)
    return ArmMetrics(
        impressions=n if request is None else len(np.unique(request)),
        samples=n,
        clicks=int(clicks),
        ctr=_mean(clicks, clicks, n, z),
        mean_predicted=_mean(float(score.sum()), float(score @ score), n, z),
        calibration=_calibration(score, label, z),
        logloss=_mean(float(loss.sum()), float(loss @ loss), n, z),
        auc=_auc(score, label, z),
    )


def arm_metrics(samples: Samples, window_s: float, level: float = LEVEL) -> dict[object, ArmReport]:
    """Every arm's report from the whole array of samples in one go (the recomputation)."""
    if not window_s > 0:
        raise ValueError(f"window_s must be positive, got {window_s}")
    cutoff = samples.ts.max() - window_s if len(samples.ts) else 0.0
    out: dict[object, ArmReport] = {}
    for key in np.unique(samples.arm):  # a loop per arm
        mine = samples.take(samples.arm == key)
        recent = mine.take(mine.ts >= cutoff)
        arm = key.item() if isinstance(key, np.generic) else key
        out[arm] = ArmReport(
            arm,
            one_arm(mine.score, mine.label, mine.request, level),
            one_arm(recent.score, recent.label, recent.request, level),
        )
    return out


class ArmsAccumulator:
    """Per-arm samples taken chunk by chunk; ``report`` equals ``arm_metrics`` of all of them.

    ``window_s``: the sliding window over event time (seconds); ``level``: interval coverage."""

    def __init__(self, window_s: float = 300.0, level: float = LEVEL) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s = window_s
        self.level = level
        self.sums: dict[object, ArmSums] = {}
        self._chunks: list[Samples] = []
        self._requests: bool | None = None

    def update(
        self,
        arm: ArrayLike,
        score: ArrayLike,
        label: ArrayLike,
        ts: ArrayLike | None = None,
        request: ArrayLike | None = None,
    ) -> None:
        """Take one chunk of samples (checked whole before any is counted)."""
        chunk = Samples.of(arm, score, label, ts, request)
        has = chunk.request is not None
        if self._requests is not None and has != self._requests:
            raise ValueError("request ids must be given with every chunk or with none")
        self._requests = has
        for key in np.unique(chunk.arm):
            mine = chunk.arm == key
            k = key.item() if isinstance(key, np.generic) else key
            self.sums[k] = self.sums.get(k, ArmSums()) + ArmSums.of(chunk.score[mine], chunk.label[mine])
        self._chunks.append(chunk)

    def samples(self) -> Samples:
        """Every sample taken, in arrival order (the chunks are joined once, then kept joined)."""
        if len(self._chunks) != 1:
            parts = self._chunks
            if not parts:
                return Samples.of(np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0))
            req = None if parts[0].request is None else np.concatenate([p.request for p in parts])
            self._chunks = [
                Samples(
                    np.concatenate([p.arm for p in parts]),
                    np.concatenate([p.score for p in parts]),
                    np.concatenate([p.label for p in parts]),
                    np.concatenate([p.ts for p in parts]),
                    req,
                )
            ]
        return self._chunks[0]

    def drop_after(self, ts: float) -> int:
        """Forget the samples of event time after ``ts`` (an experiment ended before its watcher
        knew: the samples it read meanwhile are not the experiment's); how many were dropped."""
        s = self.samples()
        late = s.ts > ts
        if not late.any():
            return 0
        kept = s.take(~late)
        self._chunks, self.sums = [kept], {}
        for key in np.unique(kept.arm):
            k = key.item() if isinstance(key, np.generic) else key
            self.sums[k] = ArmSums.of(kept.score[kept.arm == key], kept.label[kept.arm == key])
        return int(late.sum())

    def report(self) -> dict[object, ArmReport]:
        return arm_metrics(self.samples(), self.window_s, self.level)
