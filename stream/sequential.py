"""The experiment's decision rule: a sequential test that may be read after every chunk (issue 56,
part 5), comparing a candidate arm to the control arm on a per-sample metric.

Metrics: ``logloss`` (each sample's binary cross-entropy of the served score against its label;
lower is better) and ``ctr`` (the label; higher is better). Each arm is summed as (n, sum, sum of
squares) of the metric (``Moments``), which is all the test reads.

The test is the mixture sequential probability ratio test (mSPRT) of Johari, Pekelis and Walsh,
"Always valid inference" (2017), for the difference of two independent means. With
d = mean(candidate) - mean(control), V = s_c^2/n_c + s_t^2/n_t (the plug-in variance of d) and a
normal mixture N(0, tau^2) over the true difference,

    log L = 1/2 log(V / (V + tau^2)) + d^2 tau^2 / (2 V (V + tau^2))

and the rule decides once L >= 1/alpha: whatever the looks, an A/A experiment decides (promotes or
aborts) with probability at most alpha (asymptotically in n, as the plug-in variance converges).
The always-valid interval at level 1 - alpha is every difference the test would not reject:

    d +- sqrt(V (V + tau^2) / tau^2 * (2 log(1/alpha) + log((V + tau^2) / V)))

``tau`` is set relative to the metric's per-sample standard deviation (pooled over both arms), so
one default fits both metrics: tau = 0.05 tunes the test to differences of about 5% of a standard
deviation (log loss 0.45 +- 0.6: about 0.03).

Guardrails can force ``abort`` whatever the test says, each once its own evidence suffices (before
the minimum sample count): the candidate's calibration (mean predicted / observed CTR) further from 1 than control's by
more than a band once it has ``min_clicks`` clicks; and, when the caller measures them, the candidate's p99
latency against the control's and its error rate. Defaults are on ``SequentialConfig``.

We wrote the statistics here rather than adopt ``confseq`` (no wheel for Python 3.11, a C++ build,
pandas/matplotlib/pytest as runtime requirements), ``spotify-confidence`` (group-sequential tests
that need the final sample size in advance; pandas, statsmodels, chartify) or ``savvi`` (cvxpy,
numpy >= 2.1.2, per-sample regression updates rather than sums): the test is the two formulas above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

import numpy as np

from stream.arms import ArmSums

Metric = Literal["logloss", "ctr"]
LOWER_IS_BETTER: dict[str, bool] = {"logloss": True, "ctr": False}
"""The metrics the rule knows, and which way is better; any other name is refused."""


class Verdict(StrEnum):
    CONTINUE = "continue"
    PROMOTE = "promote"
    ABORT = "abort"


@dataclass(frozen=True)
class SequentialConfig:
    """The rule's settings, with their defaults."""

    metric: Metric = "logloss"
    """The per-sample metric compared: ``logloss`` (lower is better) or ``ctr`` (higher is better)."""
    alpha: float = 0.05
    """Chance that an A/A experiment ever decides (type I error over all looks)."""
    tau: float = 0.05
    """Mixing standard deviation of the difference, in units of the metric's per-sample sd."""
    min_samples: int = 10_000
    """Samples each arm needs before the test may decide: the plug-in variance needs many, and a
    request's items move together (200 items: 50 requests; bench-experiment's first thousand
    aborted a better arm)."""
    calibration_band: tuple[float, float] = (0.8, 1.25)
    """How much further from 1 than control's the candidate's calibration (mean predicted /
    observed CTR) may be, as a ratio band; beyond: abort."""
    min_clicks: int = 1_000
    """Clicks of the candidate before its calibration is judged (100 were three requests'
    worth of clicks in bench-experiment: a better arm was aborted on them)."""
    max_latency_p99_ratio: float = 1.2
    """Candidate p99 latency / control p99 latency above this: abort (when the caller gives it)."""
    max_error_rate: float = 0.01
    """Candidate error rate (failed / all requests) above this: abort (when the caller gives it)."""

    def __post_init__(self) -> None:
        if self.metric not in LOWER_IS_BETTER:
            raise ValueError(f"unknown metric {self.metric!r}; known: {sorted(LOWER_IS_BETTER)}")
        if not 0 < self.alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {self.alpha}")
        if not self.tau > 0:
            raise ValueError(f"tau must be positive, got {self.tau}")
        if self.min_samples < 2:
            raise ValueError(f"min_samples must be at least 2, got {self.min_samples}")
        low, high = self.calibration_band
        if not 0 < low < 1 < high:
            raise ValueError(f"calibration_band must hold 1 inside, got {self.calibration_band}")


@dataclass(frozen=True)
class Guardrails:
    """What the caller measured about the candidate besides the samples (None: not checked)."""

    latency_p99_ratio: float | None = None
    """Candidate p99 latency / control p99 latency."""
    error_rate: float | None = None
    """Candidate's failed requests / all its requests."""


@dataclass(frozen=True)
class Moments:
    """(n, sum, sum of squares) of a per-sample metric over one arm."""

    n: int
    total: float
    total_sq: float

    @classmethod
    def of(cls, sums: ArmSums, metric: Metric) -> Moments:
        if metric == "ctr":  # labels are 0 or 1: the sum of squares is the sum
            return cls(sums.n, sums.clicks, sums.clicks)
        if metric == "logloss":
            return cls(sums.n, sums.loss_sum, sums.loss_sq_sum)
        raise ValueError(f"unknown metric {metric!r}; known: {sorted(LOWER_IS_BETTER)}")

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else float("nan")

    @property
    def ss(self) -> float:
        """Sum of squared deviations from the mean."""
        return max(self.total_sq - self.total * self.total / self.n, 0.0) if self.n else 0.0


@dataclass(frozen=True)
class Test:
    """The mSPRT at one look."""

    log_lr: float
    """log L, the mixture likelihood ratio (0 when there is no variance yet)."""
    difference: float
    """mean(candidate) - mean(control)."""
    ci_low: float
    ci_high: float
    """The always-valid interval of the difference at level 1 - alpha."""

    @property
    def p_value(self) -> float:
        """Always valid at this look (the running minimum over looks is also valid)."""
        return float(min(1.0, np.exp(-self.log_lr)))


def msprt(control: Moments, candidate: Moments, alpha: float, tau: float) -> Test:
    """The normal-mixture SPRT of candidate against control (module docstring)."""
    d = candidate.mean - control.mean
    if control.n < 2 or candidate.n < 2:
        return Test(0.0, d, -np.inf, np.inf)
    var_c, var_t = control.ss / (control.n - 1), candidate.ss / (candidate.n - 1)
    v = var_c / control.n + var_t / candidate.n
    t2 = tau * tau * (control.ss + candidate.ss) / (control.n + candidate.n - 2)
    if v <= 0 or t2 <= 0:  # e.g. no click yet in either arm
        return Test(0.0, d, -np.inf, np.inf)
    log_lr = 0.5 * np.log(v / (v + t2)) + d * d * t2 / (2 * v * (v + t2))
    half = float(np.sqrt(v * (v + t2) / t2 * (2 * np.log(1 / alpha) + np.log((v + t2) / v))))
    return Test(float(log_lr), d, d - half, d + half)


@dataclass(frozen=True)
class Evidence:
    """What a decision rests on."""

    metric: str
    statistic: float
    """log L of the mSPRT."""
    threshold: float
    """log(1/alpha): the test decides once the statistic reaches it."""
    alpha: float
    n_control: int
    n_candidate: int
    control_mean: float
    candidate_mean: float
    difference: float
    ci_low: float
    ci_high: float
    p_value: float
    calibration: float
    """The candidate's mean predicted / observed CTR (NaN without clicks)."""
    reasons: tuple[str, ...]
    """Why the verdict, in words (a tripped guardrail names itself)."""


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    evidence: Evidence


def guardrail_trips(candidate: ArmSums, config: SequentialConfig, guards: Guardrails,
                    control: ArmSums | None = None) -> list[str]:  # fmt: skip
    """The guardrails the candidate breaks, in words (empty: none). Calibration: the candidate's
    (mean predicted / observed CTR) may be no further from 1 than control's by more than the band
    (|log| distance; control counted only once it has ``min_clicks``): a served model need not be
    calibrated to the world, a candidate must not be worse calibrated than what it would replace."""
    out = []
    low, high = config.calibration_band
    bound = max(math.log(high), -math.log(low))
    cal = candidate.calibration
    base = control.calibration if control is not None and control.clicks >= config.min_clicks else 1.0
    off, base_off = abs(math.log(cal)) if cal > 0 else math.inf, abs(math.log(base)) if base > 0 else 0.0
    if candidate.clicks >= config.min_clicks and off > base_off + bound:
        out.append(f"calibration {cal:.3f} is further from 1 than control's {base:.3f} by more than "
                   f"{low}..{high} ({candidate.clicks:.0f} clicks)")  # fmt: skip
    if guards.latency_p99_ratio is not None and guards.latency_p99_ratio > config.max_latency_p99_ratio:
        out.append(f"p99 latency ratio {guards.latency_p99_ratio:.3f} > {config.max_latency_p99_ratio}")
    if guards.error_rate is not None and guards.error_rate > config.max_error_rate:
        out.append(f"error rate {guards.error_rate:.4f} > {config.max_error_rate}")
    return out


def decide(
    control: ArmSums,
    candidate: ArmSums,
    config: SequentialConfig | None = None,
    guards: Guardrails | None = None,
) -> Decision:
    """The verdict on the candidate at this look: a guardrail abort, else the mSPRT's decision once
    both arms have ``min_samples``, else continue."""
    cfg = config or SequentialConfig()
    mc, mt = Moments.of(control, cfg.metric), Moments.of(candidate, cfg.metric)
    test = msprt(mc, mt, cfg.alpha, cfg.tau)
    threshold = float(np.log(1 / cfg.alpha))
    reasons = guardrail_trips(candidate, cfg, guards or Guardrails(), control)
    if reasons:
        verdict = Verdict.ABORT
    elif min(control.n, candidate.n) < cfg.min_samples:
        verdict = Verdict.CONTINUE
        reasons = [f"under {cfg.min_samples} samples per arm"]
    elif test.log_lr >= threshold:
        better = (test.difference < 0) == LOWER_IS_BETTER[cfg.metric]
        verdict = Verdict.PROMOTE if better else Verdict.ABORT
        reasons = [f"{cfg.metric} {'better' if better else 'worse'}: difference {test.difference:+.5f}"]
    else:
        verdict = Verdict.CONTINUE
        reasons = ["no significant difference yet"]
    return Decision(
        verdict,
        Evidence(
            cfg.metric,
            test.log_lr,
            threshold,
            cfg.alpha,
            control.n,
            candidate.n,
            mc.mean,
            mt.mean,
            test.difference,
            test.ci_low,
            test.ci_high,
            test.p_value,
            candidate.calibration,
            tuple(reasons),
        ),
    )
