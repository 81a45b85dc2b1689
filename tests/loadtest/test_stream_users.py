import numpy as np
import pytest

from loadtest.stream_users import UserModel, impressions


def click_rate(model: UserModel, items: np.ndarray, ts: float, requests: int = 400) -> float:
    """The share of ``items`` clicked over ``requests`` impressions at event time ``ts``."""
    rng = np.random.default_rng(1)
    imps = impressions(requests, ts, 0.0, b"", 200, seed=2)
    clicked = np.zeros(200)
    for imp in imps:
        for e in model.clicks(imp, rng):
            clicked[e.item] += 1
    return float(clicked[items].sum() / (requests * len(items)))


def test_a_drifting_world_changes_the_click_rate_of_a_fixed_item_set_across_phases():
    model = UserModel(ctr=0.05, score_weight=0.0, delay_s=0.0, drift_weight=2.0, drift_period_s=100.0)
    # the items most in fashion at t=0 fall out of it half a period later, and come back after one
    items = np.argsort(model.taste(200, 0.0))[-20:]
    start, half, full = (click_rate(model, items, ts) for ts in (0.0, 50.0, 100.0))
    assert start > 4 * half
    assert full == pytest.approx(start, rel=0.25)


def test_without_drift_the_click_rate_does_not_move_with_time():
    model = UserModel(ctr=0.05, score_weight=0.0, delay_s=0.0)
    items = np.arange(20)
    assert click_rate(model, items, 0.0) == click_rate(model, items, 50.0)  # the same draws, no taste
    assert not model.taste(200, 50.0).any()


def test_drift_settings_are_checked():
    with pytest.raises(ValueError, match="drift"):
        UserModel(drift_weight=1.0, drift_period_s=0.0)


def test_a_reference_world_clicks_each_item_at_its_reference_rate_whatever_it_is_scored():
    reference = tuple(np.linspace(0.02, 0.6, 200).tolist())
    model = UserModel(delay_s=0.0, reference=reference)
    high, low = np.arange(150, 200), np.arange(0, 50)
    rate = click_rate(model, high, 0.0, requests=200)
    assert rate == pytest.approx(float(np.mean(np.array(reference)[high])), abs=0.03)
    assert click_rate(model, low, 0.0, requests=200) < rate / 3  # the random scores do not matter
    p = model.click_probability(np.zeros(200), 0.0)
    assert p == pytest.approx(np.array(reference))


def test_a_drift_origin_zeroes_every_taste_at_that_time_and_not_later():
    model = UserModel(drift_weight=1.0, drift_period_s=100.0, drift_origin_s=30.0)
    assert not model.taste(200, 30.0).any()
    assert np.abs(model.taste(200, 55.0)).max() > 1.0
    assert model.taste(200, 130.0) == pytest.approx(np.zeros(200), abs=1e-9)


def test_a_reference_must_be_probabilities_and_match_the_request():
    with pytest.raises(ValueError, match="reference"):
        UserModel(reference=(0.5, 1.0))
    with pytest.raises(ValueError, match="reference of 2"):
        UserModel(reference=(0.5, 0.2)).click_probability(np.zeros(3), 0.0)


def test_without_a_tail_the_delays_are_the_exponential_draws_of_before():
    model, rng, before = UserModel(delay_s=2.0), np.random.default_rng(3), np.random.default_rng(3)
    assert model.delays(1000, rng) == pytest.approx(before.exponential(2.0, 1000))
    assert not UserModel(delay_s=0.0).delays(5, rng).any()


def test_a_heavy_tailed_world_clicks_its_fast_share_within_seconds_and_the_rest_over_a_long_horizon():
    model = UserModel(delay_s=1.0, fast_share=0.5, tail_median_s=20.0, tail_sigma=1.5)
    d = model.delays(200_000, np.random.default_rng(4))
    assert np.mean(d <= 5.0) == pytest.approx(0.5 * (1 - np.exp(-5.0)) + 0.5 * 0.178, abs=0.01)
    assert np.mean(d > 120.0) == pytest.approx(0.5 * 0.116, abs=0.005)  # past a 120 s attribution window
    tail = UserModel(fast_share=0.0, tail_median_s=20.0).delays(100_000, np.random.default_rng(5))
    assert np.median(tail) == pytest.approx(20.0, rel=0.03)


def test_a_clock_starts_the_same_world_at_another_time():
    a = UserModel(drift_weight=1.0, drift_period_s=100.0, drift_origin_s=0.0)
    b = UserModel(drift_weight=1.0, drift_period_s=100.0, drift_origin_s=1_000_037.0, clock_s=1_000_037.0)
    assert b.taste(200, 1_000_037.0 + 33.0) == pytest.approx(a.taste(200, 33.0))


def test_delay_settings_are_checked():
    with pytest.raises(ValueError, match="fast_share"):
        UserModel(fast_share=1.5)
    with pytest.raises(ValueError, match="tail_median_s"):
        UserModel(fast_share=0.5, tail_median_s=0.0)


def test_a_slate_ctr_shifts_every_item_by_one_logit_to_that_mean_over_a_drift_period():
    reference = tuple(np.linspace(0.02, 0.4, 200).tolist())
    model = UserModel(
        reference=reference, slate_ctr=0.03, drift_weight=2.0, drift_period_s=100.0, clock_s=50.0
    )
    ts = 50.0 + np.arange(0.0, 100.0, 0.5)[:, None]
    p = model.click_probability(np.zeros(200), ts)
    assert p.shape == (200, 200) and p.mean() == pytest.approx(0.03, rel=0.01)
    assert p.mean(axis=1).max() / p.mean(axis=1).min() < 1.25  # the items' phases spread: a steady rate
    logit = np.log(p) - np.log1p(-p)
    ref = np.log(np.array(reference)) - np.log1p(-np.array(reference))
    np.testing.assert_allclose(logit - model.taste(200, ts) - ref, model.shift, atol=1e-6)  # one shift
    assert UserModel(reference=reference).shift == 0.0
    with pytest.raises(ValueError, match="slate_ctr needs a reference"):
        UserModel(slate_ctr=0.03)


def test_the_process_that_plays_the_users_is_frozen_once_before_it_plays(monkeypatch):
    """Its imports out of the collector's scans (``serving.memory.freeze_loaded``): a full
    collection held the bench's process, and the clicks it sends, 0.24-0.30 s every 10 s."""
    import threading

    from loadtest.stream_users import play
    from serving import memory

    calls: list[int] = []
    monkeypatch.setattr(memory, "freeze_loaded", lambda: calls.append(1) or 0)
    stop = threading.Event()
    stop.set()  # no broker is asked: it stops before its first turn
    assert play("127.0.0.1:1", UserModel(), stop) == 0
    assert calls == [1]
