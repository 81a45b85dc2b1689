"""The output guard alone: windows of served scores against their band trip it when the served
AUC falls (labels inverted) or the calibration leaves the band; it clears when they are back, and
a tripped window never joins the band. ``Cuts.good`` picks the last delta cut before the trip."""

from __future__ import annotations

import numpy as np
import pytest

from training.follow.guard import OutputGuard, OutputGuardConfig
from training.follow.revert import Cuts

CFG = OutputGuardConfig(window=1000, band_windows=5, min_band_windows=3, max_auc_drop=0.2, clear_windows=2)


def world(rng, n: int, invert: bool = False, scale: float = 1.0):
    """Served scores of a fair model (AUC about 0.75) and the labels they predict (inverted: wrong)."""
    score = rng.beta(1, 4, n)
    label = (rng.random(n) < score).astype(np.float64)
    return np.clip(score * scale, 0, 1), 1 - label if invert else label


def test_inverted_labels_trip_and_clear_and_never_join_the_band():
    rng, g = np.random.default_rng(0), OutputGuard(CFG)
    events = [g.saw(*world(rng, 500)) for _ in range(8)]  # 4 windows: the band
    assert set(events) == {""} and len(g.band) == 4 and not g.tripped
    events = [g.saw(*world(rng, 500, invert=True)) for _ in range(2)]
    assert events == ["", "trip"] and g.tripped and "served AUC" in g.reason
    assert g.since_sample == 4000  # where the window that tripped began
    assert [g.saw(*world(rng, 500, invert=True)) for _ in range(4)] == [""] * 4 and len(g.band) == 4
    assert [g.saw(*world(rng, 500)) for _ in range(4)] == ["", "", "", "clear"]  # two good windows in a row
    assert (g.trips, g.recoveries, g.tripped) == (1, 1, False)


def test_a_miscalibrated_window_trips():
    rng, g = np.random.default_rng(1), OutputGuard(CFG)
    for _ in range(4):
        g.saw(*world(rng, 1000))
    assert g.saw(*world(rng, 1000, scale=4.0)) == "trip" and "calibration" in g.reason


def test_constant_scores_judge_nothing():
    g = OutputGuard(CFG)
    for i in range(6):
        assert g.saw(np.zeros(1000), (np.arange(1000) % 5 == i % 5).astype(float)) == ""


def test_the_last_good_delta_is_the_newest_cut_before_the_trip():
    cuts = Cuts(base=4, cut=[(5, 1000), (6, 2500), (7, 4100)])
    assert cuts.good(4000) == 6 and cuts.good(2500) == 6 and cuts.good(900) == 4


def test_bad_thresholds_are_refused():
    with pytest.raises(ValueError, match="window >= 100"):
        OutputGuardConfig(window=10)
    with pytest.raises(ValueError, match="max_calibration_ratio > 1"):
        OutputGuardConfig(max_calibration_ratio=1.0)
