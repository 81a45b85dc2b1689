import numpy as np
import pytest

from loadtest import delayed_figures as df
from loadtest.stream_figures import keys_of
from stream.records import Event, Impression, Versions
from stream.sample_batch import KIND_BIT


def imp(rid: str, ts: float, scores: list[float]) -> Impression:
    return Impression(rid, ts, Versions("v1", 0, "v1"), np.array(scores, np.float32), b"")


def world() -> df.World:
    """Two impressions of 3 items; clicks after 1 s, 50 s and 500 s."""
    drawn = df.Drawn()
    drawn(imp("r0", 100.0, [0.5, 0.1, 0.2]), [Event("r0", 0, 1.0, 101.0), Event("r0", 2, 1.0, 150.0)])
    drawn(imp("r1", 110.0, [0.4, 0.3, 0.2]), [Event("r1", 1, 1.0, 610.0)])
    return drawn.world()


def test_the_world_records_each_impression_and_each_click_with_its_delay():
    w = world()
    assert w.request_ids.tolist() == [b"r0", b"r1"] and w.scores.shape == (2, 3)
    assert w.click_delays.tolist() == [1.0, 50.0, 500.0]
    assert w.click_keys.tolist() == keys_of(np.array([b"r0", b"r0", b"r1"]), np.array([0, 2, 1])).tolist()


def test_final_labels_are_the_clicks_within_the_attribution_window_whether_sent_or_not():
    assert df.final_labels(world(), 120.0).tolist() == [[1, 0, 1], [0, 0, 0]]
    assert df.final_labels(world(), 600.0).tolist() == [[1, 0, 1], [0, 1, 0]]


def test_quality_is_auc_logloss_and_mean_predicted_over_observed():
    q = df.quality(np.array([0.9, 0.1, 0.8, 0.2]), np.array([1.0, 0.0, 0.0, 0.0]))
    assert q["auc"] == 1.0 and q["calibration"] == pytest.approx(0.5 / 0.25)
    assert df.quality(np.array([0.5]), np.array([0.0]))["auc"] is None  # one label only: no AUC


def test_served_quality_scores_the_impressions_of_its_span_and_the_frozen_model_on_them():
    q = df.served_quality(world(), 120.0, 0.0, 105.0, np.array([0.1, 0.2, 0.3], np.float32))
    assert q["n"] == 3 and q["auc"] == 1.0 and q["frozen_auc"] == 0.5


def test_a_click_past_the_first_horizon_is_keyed_as_a_correction_only_when_the_joiner_corrects():
    w = world()
    sent = (w.click_keys[:2], np.array([101.0, 150.0]))
    plain = df.sent_clicks(sent, w, 2.0, correcting=False)
    assert not df.is_correction(plain.keys).any() and plain.delays.tolist() == [1.0, 50.0]
    corrected = df.sent_clicks(sent, w, 2.0, correcting=True)
    assert df.is_correction(corrected.keys).tolist() == [False, True]
    item = int.from_bytes(corrected.keys[1][:4], "big")
    assert item == 2 | KIND_BIT
    assert df.expected_corrections(corrected, 2.0, 120.0).tolist() == [corrected.keys[1]]
    assert not len(df.expected_corrections(corrected, 2.0, 50.5))  # within the margin of the window's end


def test_a_click_the_world_never_drew_is_refused():
    with pytest.raises(ValueError, match="never drew"):
        df.sent_clicks((keys_of(np.array([b"r9"]), np.array([0])), np.array([1.0])), world(), 2.0, True)


def test_calibration_every_bucket_of_impressions():
    assert df.calibration_every(world(), 120.0, 100.0, 120.0, 10.0) == [
        pytest.approx(0.8 / 2, abs=1e-3),
        None,
    ]


def test_rss_mb_takes_the_second_minute_the_last_and_the_most():
    samples = [(0.0, 100 * 2**20), (70.0, 300 * 2**20), (130.0, 200 * 2**20)]
    assert df.rss_mb(samples, 0.0) == {"second_minute": 300.0, "last": 200.0, "max": 300.0}


def test_fnw_settles_above_one_by_the_share_of_clicks_that_never_came_as_a_negative():
    delays = np.array([1.0, 1.0, 50.0, 50.0, 500.0])  # half of the final clicks (within 120 s) fast
    p = np.array([[0.2, 0.2], [0.2, 0.2]])
    assert df.fixed_point(p, delays, 2.0, 120.0, "fnw", True) == pytest.approx(1 / (1 - 0.2 * 0.5), abs=1e-4)
    assert df.fixed_point(p, delays, 2.0, 120.0, "esdfm", True) == 1.0
    assert df.fixed_point(p, delays, 2.0, 120.0, "none", False) == 0.5  # drop-late: the fast half
    assert df.fixed_point(p, delays, 120.0, 120.0, "none", False) == 1.0  # wait for all
    assert df.fixed_point(p, np.array([50.0]), 2.0, 120.0, "fnw", True) == 1.0  # every click late: unbiased
    # common clicks weigh more: the mean of p / (1 - p q) over the clicks, not at the mean p
    mixed = df.fixed_point(np.array([0.02, 0.38]), delays, 2.0, 120.0, "fnw", True)
    assert mixed > df.fixed_point(np.full(2, 0.2), delays, 2.0, 120.0, "fnw", True)


def test_an_arm_has_settled_when_its_calibration_moved_at_most_two_percent_from_the_span_before():
    assert df.settled(1.0, 1.015) == {"calibration_before": 1.0, "calibration_measured": 1.015, "change": 0.015,
                                      "settled": True}  # fmt: skip
    assert df.settled(1.2, 1.1)["settled"] is False and df.settled(1.2, 1.1)["change"] == pytest.approx(
        -0.0833
    )
    assert df.settled(None, 1.1) == {"calibration_before": None, "calibration_measured": 1.1, "change": None,
                                     "settled": False}  # fmt: skip
