import numpy as np
import pytest

from stream.aa import aa_replays, in_candidate, replay
from stream.arms import ArmSums
from stream.sequential import Guardrails, Moments, SequentialConfig, Verdict, decide, msprt

ALPHA = 0.05

SMALL = SequentialConfig(min_samples=1000, min_clicks=100)
"""The rule on a few thousand samples (the defaults want ten times as many)."""


def world(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(true click rates, labels, a worse model's scores: logit noise sd 1) of n samples."""
    rng = np.random.default_rng(seed)
    logit = rng.normal(-1.4, 1.0, n)
    p = 1 / (1 + np.exp(-logit))
    worse = 1 / (1 + np.exp(-(logit + rng.normal(0, 1.0, n))))
    return p, (rng.random(n) < p).astype(np.float64), worse


def test_a_clearly_better_candidate_is_promoted_with_its_evidence():
    p, y, worse = world(20_000, seed=0)
    d = decide(ArmSums.of(worse[::2], y[::2]), ArmSums.of(p[1::2], y[1::2]))
    assert d.verdict is Verdict.PROMOTE
    e = d.evidence
    assert (e.metric, e.alpha, e.n_control, e.n_candidate) == ("logloss", ALPHA, 10_000, 10_000)
    assert e.statistic >= e.threshold == pytest.approx(np.log(1 / ALPHA))
    assert e.difference == pytest.approx(e.candidate_mean - e.control_mean)
    assert e.ci_low < e.difference < e.ci_high < 0  # lower log loss, and the interval says so
    assert e.p_value < ALPHA


def test_a_clearly_worse_candidate_is_aborted():
    p, y, worse = world(20_000, seed=1)
    d = decide(ArmSums.of(p[::2], y[::2]), ArmSums.of(worse[1::2], y[1::2]))
    assert d.verdict is Verdict.ABORT and d.evidence.ci_low > 0 and "worse" in d.evidence.reasons[0]


def test_ctr_higher_is_better():
    rng = np.random.default_rng(2)
    control = (rng.random(20_000) < 0.10).astype(np.float64)
    candidate = (rng.random(20_000) < 0.13).astype(np.float64)
    cfg = SequentialConfig(metric="ctr")
    up = decide(ArmSums.of(np.full(20_000, 0.1), control), ArmSums.of(np.full(20_000, 0.13), candidate), cfg)
    down = decide(
        ArmSums.of(np.full(20_000, 0.13), candidate), ArmSums.of(np.full(20_000, 0.1), control), cfg
    )
    assert (up.verdict, down.verdict) == (Verdict.PROMOTE, Verdict.ABORT)
    assert up.evidence.difference == pytest.approx(candidate.mean() - control.mean())


def test_under_min_samples_the_rule_continues_whatever_the_difference():
    p, y, _ = world(1998, seed=3)
    coin = np.full(999, 0.5)  # a control that knows nothing
    d = decide(ArmSums.of(coin, y[::2]), ArmSums.of(p[1::2], y[1::2]), SMALL)
    assert d.verdict is Verdict.CONTINUE and "under 1000 samples" in d.evidence.reasons[0]
    assert d.evidence.statistic > d.evidence.threshold  # it would have decided with enough samples


def test_a_miscalibrated_candidate_is_aborted_once_it_has_enough_clicks():
    p, y, _ = world(4000, seed=4)
    over = np.clip(2 * p, 0, 1)  # predicts about twice the clicks it gets
    d = decide(ArmSums.of(p[::2], y[::2]), ArmSums.of(over[1::2], y[1::2]), SMALL)
    assert d.verdict is Verdict.ABORT and d.evidence.calibration > 1.25
    assert "calibration" in d.evidence.reasons[0]
    few = decide(ArmSums.of(p[:20], y[:20]), ArmSums.of(over[:20], y[:20]), SMALL)  # under min_clicks
    assert few.verdict is Verdict.CONTINUE


def test_the_callers_guardrails_abort_when_given_and_past_their_limits():
    p, y, _ = world(400, seed=5)
    arms = ArmSums.of(p[::2], y[::2]), ArmSums.of(p[1::2], y[1::2])
    assert (
        decide(*arms, guards=Guardrails(latency_p99_ratio=1.1, error_rate=0.001)).verdict is Verdict.CONTINUE
    )
    slow = decide(*arms, guards=Guardrails(latency_p99_ratio=1.5))
    assert slow.verdict is Verdict.ABORT and "p99 latency" in slow.evidence.reasons[0]
    failing = decide(*arms, guards=Guardrails(error_rate=0.05))
    assert failing.verdict is Verdict.ABORT and "error rate" in failing.evidence.reasons[0]


def test_the_interval_is_every_difference_the_test_would_not_reject():
    rng = np.random.default_rng(6)
    a, b = rng.normal(0.5, 0.6, 3000), rng.normal(0.47, 0.6, 3000)
    ma, mb = Moments(len(a), a.sum(), a @ a), Moments(len(b), b.sum(), b @ b)
    t = msprt(ma, mb, ALPHA, 0.05)
    for bound in (t.ci_low, t.ci_high):  # shift the candidate by the bound: the test sits on its threshold
        c = b - bound
        at = msprt(ma, Moments(len(c), c.sum(), c @ c), ALPHA, 0.05)
        assert at.log_lr == pytest.approx(np.log(1 / ALPHA), rel=1e-6)


def test_a_a_replays_decide_at_most_alpha_of_the_time():
    """100 independent simulated A/A experiments of 20,000 samples, looked at every 1,000."""
    false = 0
    for seed in range(100):
        p, y, _ = world(20_000, seed=100 + seed)
        units = np.arange(20_000, dtype=np.uint64)
        r = replay(in_candidate(units, seed), p, p, y, SequentialConfig(), chunk=1000)
        false += r.decision.verdict is not Verdict.CONTINUE
    assert false <= 100 * ALPHA


def test_a_a_replays_of_one_log_with_salted_splits():
    p, y, _ = world(20_000, seed=7)
    units = np.char.add("u", np.arange(20_000).astype(np.str_))
    result = aa_replays(units, p, y, replays=50)
    assert result.replays == 50 and result.samples == 20_000 and result.alpha == ALPHA
    assert result.false_decision_rate == (result.false_promotions + result.false_aborts) / 50 <= ALPHA


def test_a_unit_always_lands_in_one_arm_and_the_salt_moves_it():
    units = np.array(["u1", "u2", "u3", "u1", "u2", "u1"] * 500)
    first = in_candidate(units, salt=3)
    assert all(len(set(first[units == u])) == 1 for u in ("u1", "u2", "u3"))
    assert np.array_equal(first, in_candidate(units, salt=3))
    keys = np.arange(100_000, dtype=np.uint64)
    assert in_candidate(keys, 1).mean() == pytest.approx(0.5, abs=0.01)
    assert in_candidate(keys, 1, share=0.1).mean() == pytest.approx(0.1, abs=0.01)
    assert (in_candidate(keys, 1) != in_candidate(keys, 2)).mean() == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize(
    "kwargs, problem",
    [
        ({"metric": "auc"}, "unknown metric 'auc'"),
        ({"alpha": 1.5}, "alpha must be in"),
        ({"tau": 0}, "tau must be positive"),
        ({"min_samples": 1}, "min_samples"),
        ({"calibration_band": (1.1, 1.25)}, "calibration_band"),
    ],
)
def test_a_bad_config_is_refused_by_name(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        SequentialConfig(**kwargs)


def test_malformed_replay_inputs_are_refused_by_name():
    p, y, _ = world(100, seed=8)
    units = np.arange(100, dtype=np.uint64)
    with pytest.raises(ValueError, match="different lengths"):
        aa_replays(units[:50], p, y, replays=1)
    with pytest.raises(ValueError, match="NaN"):
        aa_replays(units, np.where(np.arange(100) == 5, np.nan, p), y, replays=1)
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        aa_replays(units, p, y * 2, replays=1)
    with pytest.raises(ValueError, match="unit keys must be strings or unsigned"):
        in_candidate(np.arange(3.0), 0)


def test_calibration_is_judged_against_controls():
    """A served model need not be calibrated to the world: a candidate as far off as control
    passes, one further off than control by more than the band is aborted."""
    p, y, _ = world(4000, seed=5)
    control, alike, worse = np.clip(3 * p, 0, 1), np.clip(3.2 * p, 0, 1), np.clip(9 * p, 0, 1)
    d = decide(ArmSums.of(control[::2], y[::2]), ArmSums.of(alike[1::2], y[1::2]), SMALL)
    assert not any("calibration" in r for r in d.evidence.reasons)
    d = decide(ArmSums.of(control[::2], y[::2]), ArmSums.of(worse[1::2], y[1::2]), SMALL)
    assert d.verdict is Verdict.ABORT and "further from 1 than control's" in d.evidence.reasons[0]
