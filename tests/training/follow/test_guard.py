"""The output guard alone: windows of served scores against their band trip it when the served
AUC falls (labels inverted) or the calibration leaves the band; it clears when they are back, and
a tripped window never joins the band. ``Cuts.good`` picks the last delta cut before the trip."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from training.follow.guard import OutputGuard, OutputGuardConfig
from training.follow.revert import Cuts, Rewinder

CFG = OutputGuardConfig(window=1000, band_windows=5, min_band_windows=3, max_auc_drop=0.2, clear_windows=2,
                         warmup_windows=0)  # fmt: skip


def world(rng, n: int, invert: bool = False, scale: float = 1.0, blur: float = 0.0):
    """Served scores of a fair model (AUC about 0.78) and the labels they predict (inverted: wrong;
    ``blur``: that share of the labels shuffled, 0.6: AUC about 0.61)."""
    score = rng.beta(1, 4, n)
    label = (rng.random(n) < score).astype(np.float64)
    mixed = rng.random(n) < blur
    label[mixed] = rng.permutation(label[mixed])
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


def test_the_first_windows_neither_judge_nor_join_the_band():
    rng, g = np.random.default_rng(2), OutputGuard(OutputGuardConfig(window=1000, warmup_windows=2))
    assert [g.saw(*world(rng, 1000, invert=True)) for _ in range(2)] == ["", ""] and not g.band
    assert g.saw(*world(rng, 1000)) == "" and len(g.band) == 1


def test_clicks_are_judged_with_the_rest_of_their_request():
    """The join emits a click at once and its request's other items a window later: the guard
    holds the clicks until their requests' negatives come, and judges whole requests."""
    g = OutputGuard(OutputGuardConfig(window=100, warmup_windows=0))
    rids = np.repeat(np.array([f"r{i}".encode() for i in range(10)]), 20)  # 10 requests of 20 items
    score = np.tile(np.linspace(0, 1, 20), 10)
    label = (np.tile(np.arange(20), 10) >= 16).astype(float)  # each request's 4 best items clicked
    clicks, rest = label == 1, label == 0
    assert g.saw(score[clicks], label[clicks], rids[clicks]) == "" and g.last is None  # held back
    g.saw(score[rest], label[rest], rids[rest])
    assert g.last is not None and g.last.auc == 1.0  # the clicks met their own requests' items


def test_bad_thresholds_are_refused():
    with pytest.raises(ValueError, match="window >= 100"):
        OutputGuardConfig(window=10)
    with pytest.raises(ValueError, match="max_calibration_ratio > 1"):
        OutputGuardConfig(max_calibration_ratio=1.0)


def test_after_a_long_stretch_with_nothing_read_the_band_forms_anew():
    """The input guard held the join for 90 s: the served model learnt nothing, and windows of a
    stale model are judged against a band of their own, not one of before."""
    rng, g = np.random.default_rng(4), OutputGuard(CFG)
    now = [0.0]
    g.clock = lambda: now[0]
    for _ in range(4):
        g.saw(*world(rng, 1000))
        now[0] += 1.0
    assert len(g.band) == 4
    now[0] += 90.0  # nothing read
    stale = world(rng, 1000, scale=4.0)  # would trip the band of before (calibration)
    assert g.saw(*stale) == "" and (len(g.band), g.resets) == (1, 1) and not g.tripped
    now[0] += 1.0
    assert g.saw(*world(rng, 1000, scale=4.0)) == "" and len(g.band) == 2


def test_no_idle_reset_when_told_so():
    rng = np.random.default_rng(5)
    g = OutputGuard(
        OutputGuardConfig(window=1000, band_windows=5, min_band_windows=3, warmup_windows=0, idle_reset_s=0)
    )
    now = [0.0]
    g.clock = lambda: now[0]
    for _ in range(4):
        g.saw(*world(rng, 1000))
    now[0] += 1000.0
    assert g.saw(*world(rng, 1000, scale=4.0)) == "trip" and g.resets == 0


def test_only_windows_read_wholly_after_the_trip_clear_it():
    """A request clicked before the trip and closed after it was served by the model that tripped:
    its window, healthy or not, does not count towards the clear."""
    g = OutputGuard(OutputGuardConfig(window=100, band_windows=5, min_band_windows=3, warmup_windows=0))
    rng = np.random.default_rng(6)

    def request(rid: bytes, invert: bool = False):
        s, y = world(rng, 200, invert=invert)
        return s, y, np.full(200, rid)

    for i in range(4):
        g.saw(*request(b"good%d" % i))
    s, y, r = request(b"straddles")
    assert g.saw(s[y == 1], y[y == 1], r[y == 1]) == ""  # its clicks, read before the trip: held
    assert g.saw(*request(b"bad", invert=True)) == "trip"
    assert g.saw(s[y == 0], y[y == 0], r[y == 0]) == ""  # its negatives: a healthy window, not counted
    assert g.last is not None and g.last.auc > 0.6
    assert [g.saw(*request(b"after%d" % i)) for i in range(2)] == ["", "clear"]


def test_the_last_good_delta_is_the_newest_that_served_a_clearly_healthy_window():
    """bench-guard's inverted clicks, trained as they came, made a model that agreed with them:
    the bad stretch's windows fell short of a trip but outside half its bounds, and the window that
    tripped was served by a delta cut long after the poison began. The rewind goes back to the delta
    of the last window within half the bounds."""
    rng = np.random.default_rng(7)
    g = OutputGuard(replace(CFG, window=2000))
    for seq in (10, 11, 12, 13):
        assert g.saw(*world(rng, 2000), None, np.full(2000, seq)) == ""
    assert g.good_delta == 13
    for seq in (14, 15):  # AUC about 0.61 against a band of 0.78: no trip, not clearly healthy
        assert g.saw(*world(rng, 2000, blur=0.6), None, np.full(2000, seq)) == "" and not g.tripped
    assert g.good_delta == 13
    assert g.saw(*world(rng, 2000, invert=True), None, np.full(2000, 16)) == "trip"
    r = Rewinder(g)
    r.cuts = Cuts(base=9, cut=[(seq, 2000 * (seq - 9)) for seq in range(10, 17)])
    assert r.cuts.good(g.since_sample) == 15 and r.target() == 13


def test_only_windows_served_by_the_rewound_rows_clear_it():
    rng = np.random.default_rng(8)
    g = OutputGuard(CFG)
    for _ in range(4):
        g.saw(*world(rng, 1000), None, np.full(1000, 5))
    assert g.saw(*world(rng, 1000, invert=True), None, np.full(1000, 6)) == "trip"
    g.served_from = 7  # the rewind's delta (``Rewinder.cut``)
    assert [g.saw(*world(rng, 1000), None, np.full(1000, 6)) for _ in range(3)] == ["", "", ""]
    assert g.tripped  # healthy windows, but served by the model that tripped
    assert [g.saw(*world(rng, 1000), None, np.full(1000, 7)) for _ in range(2)] == ["", "clear"]
    assert g.served_from is None


def test_a_calibration_that_comes_nearer_1_than_its_band_is_no_trip():
    """A served model that started over-predicting 4x and learns the world's rate: its calibration
    falls to 1, a quarter of its band's, and that is no trip; one that falls on under 1 is."""
    rng = np.random.default_rng(9)
    g = OutputGuard(CFG)
    for _ in range(4):
        g.saw(*world(rng, 1000, scale=4.0))  # over-predicting 4x: the band
    assert g.saw(*world(rng, 1000)) == "" and not g.tripped  # calibrated now: nearer 1
    g = OutputGuard(CFG)
    for _ in range(4):
        g.saw(*world(rng, 1000, scale=4.0))
    assert g.saw(*world(rng, 1000, scale=0.15)) == "trip" and "calibration" in g.reason  # far under 1
