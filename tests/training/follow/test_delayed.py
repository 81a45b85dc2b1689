"""The delayed-feedback losses' weights: fake negative weighting and its elapsed-time-aware
variant, against their formulas."""

from __future__ import annotations

import numpy as np
import pytest

from training.follow.delayed import DelayCdf, DelayedFeedback, settles_at

P = np.array([0.1, 0.5, 0.1, 0.5])
LABELS = np.array([1.0, 1.0, 0.0, 0.0], np.float32)


def test_none_weighs_every_sample_one():
    assert DelayedFeedback("none").weights(P, LABELS, np.zeros(4)) is None


def test_fnw_weighs_positives_one_plus_p_and_negatives_one_minus_p_squared():
    w = DelayedFeedback("fnw").weights(P, LABELS, np.array([3.0, 400.0, 5.0, 5.0]))
    np.testing.assert_allclose(w, [1.1, 1.5, 0.99, 0.75], rtol=1e-6)


def test_esdfm_is_fnw_until_a_click_is_seen_then_counts_only_clicks_later_than_the_horizon():
    esdfm = DelayedFeedback("esdfm")
    np.testing.assert_allclose(esdfm.weights(P[2:], LABELS[2:], np.full(2, 5.0)), [0.99, 0.75], rtol=1e-6)
    esdfm.weights(np.full(4, 0.2), np.ones(4, np.float32), np.array([1.0, 2.0, 4.0, 60.0]))
    # with this batch's two clicks (3 s), 5 of 6 clicks came within the 5 s the negatives waited: a
    # click is a fake negative first one time in 6, for every sample (a positive's horizon is 5 s too)
    w = esdfm.weights(P, LABELS, np.array([3.0, 3.0, 5.0, 5.0]))
    f = P / 6
    expected = np.where(LABELS > 0, 1 + f, (1 + f) * (1 - P) / (1 - P + f))
    np.testing.assert_allclose(w, expected, rtol=1e-6)
    assert (w[2:] < 1).all() and (w[2:] > DelayedFeedback("fnw").weights(P, LABELS, np.zeros(4))[2:]).all()


def test_the_delay_distribution_counts_each_click_once_to_its_bin():
    cdf = DelayCdf()
    assert cdf.at(np.array([10.0])).tolist() == [0.0]
    cdf.add(np.array([0.5, 2.0, 90.0, 7200.0]))
    assert cdf.at(np.array([0.0, 1.0, 100.0, 1e7])).tolist() == [0.0, 0.25, 0.75, 1.0]


def test_an_unknown_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="--delayed-feedback must be one of none, fnw, esdfm, got 'fwn'"):
        DelayedFeedback("fwn")


def stream(p: float, q: float, correcting: bool, n: int = 200_000) -> tuple:
    """The samples a joiner with a 2 s first horizon emits for ``n`` impressions of an item clicked
    with probability ``p``, a share ``q`` of the clicks at 0.5 s and the rest at 50 s (labels,
    elapsed), and the draws' own p and q (so the check is exact for the sample)."""
    rng = np.random.default_rng(0)
    click = rng.random(n) < p
    fast = click & (rng.random(n) < q)
    late = click & ~fast
    first = np.where(fast, 1.0, 0.0), np.where(fast, 0.5, 2.0)  # one first label each
    labels = np.concatenate([first[0], np.ones(late.sum() * correcting)]).astype(np.float32)
    elapsed = np.concatenate([first[1], np.full(late.sum() * correcting, 50.0)])
    return labels, elapsed, click.mean(), fast.sum() / click.sum()


def minimiser(mode: str, labels: np.ndarray, elapsed: np.ndarray) -> float:
    """The prediction m where the weighted log loss's gradient is zero, the weights computed at m
    (held constant in the gradient, as in training): sum w (m - y) = 0, by fixed-point iteration."""
    fb, m = DelayedFeedback(mode), 0.5
    for _ in range(100):
        w = fb.weights(np.full(len(labels), m), labels, elapsed)
        w = np.ones(len(labels)) if w is None else w.astype(np.float64)
        m = float((w * labels).sum() / w.sum())
    return m


@pytest.mark.parametrize("mode,correcting", [("none", False), ("none", True), ("fnw", True), ("esdfm", True)])
@pytest.mark.parametrize("p", [0.03, 0.35])
def test_each_loss_settles_where_settles_at_says(mode, correcting, p):
    labels, elapsed, p_drawn, q_drawn = stream(p, 0.5, correcting)
    m = minimiser(mode, labels, elapsed)
    assert m == pytest.approx(float(settles_at(mode, np.array([p_drawn]), q_drawn, correcting)[0]), rel=1e-3)


def test_fnw_over_predicts_by_one_over_one_minus_p_q_and_esdfm_does_not():
    p, q = np.array([0.03, 0.35]), 0.5
    np.testing.assert_allclose(settles_at("fnw", p, q, True) / p, 1 / (1 - p * q))  # 1.015, 1.21
    np.testing.assert_allclose(settles_at("esdfm", p, q, True), p)
    np.testing.assert_allclose(settles_at("none", p, q, False), p * q)  # drop-late: the fast clicks only
    np.testing.assert_allclose(settles_at("none", p, 1.0, False), p)  # wait for all: no click later
    with pytest.raises(ValueError, match="got 'fwn'"):
        settles_at("fwn", p, q, True)
