"""The input guard alone (no Kafka): it trips when the label rate falls under its band, when a
partition's events trail its impressions, and when a slot goes empty; it clears only when a judged
window has the measure back, saying why; nothing is judged while it warms up or over a thin window
(healthy stays healthy, a trip holds), and a tripped stretch, however long, never becomes the band
nor ages it out."""

from __future__ import annotations

import numpy as np
import pytest

from stream.guard import GuardConfig, InputGuard

CFG = GuardConfig(window_s=5, band_s=60, min_items=100, warmup_items=1000)


def feed(guard: InputGuard, start: int, seconds: int, items: int, events: int, empty=None, lag: float = 0.0):
    """``seconds`` seconds of traffic from ``start``, judged each second; the last judgement."""
    trip = None
    for t in range(start, start + seconds):
        guard.saw(t + 0.5, items, events, None if empty is None else np.asarray(empty))
        trip = guard.judge(t + 0.9, {0: (lag, (t + 1) * items)})
    return trip


def test_a_label_rate_under_its_band_trips_and_its_return_clears():
    g = InputGuard(CFG)
    assert feed(g, 0, 30, items=100, events=8) is None  # 8% labels: the band
    assert g.band == pytest.approx(0.08)
    trip = feed(g, 30, 5, items=100, events=0)  # clicks stop
    assert trip is not None and trip.measure == "label_rate" and "under 0.25 x its band 0.0800" in trip.reason
    assert g.trips["label_rate"] == 1
    assert feed(g, 35, 10, items=100, events=0) is not None  # still out: still tripped, one trip
    assert g.band == pytest.approx(0.08)  # the outage never became the band
    assert feed(g, 45, 3, items=100, events=100) is None  # the delayed clicks arrive: a burst clears
    assert (g.trips["label_rate"], g.recoveries) == (1, 1) and g.tripped_s > 0
    # tripped at 34.9 s (8 events in 600 items), cleared at 45.9 s (100 in 600): why it cleared
    assert g.cleared == "label rate 0.1667 over the last 5s is back at >= 0.5 x its band 0.0800 after 11.0s"


def test_a_trip_holds_through_a_thin_window_and_clears_on_a_judged_one():
    g = InputGuard(CFG)
    feed(g, 0, 30, items=100, events=8)
    assert feed(g, 30, 5, items=100, events=0) is not None
    for t in range(35, 45):  # night traffic, no clicks: 10 items a second, under min_items a window
        assert feed(g, t, 1, items=10, events=0) is not None, t
    assert g.recoveries == 0 and g.cleared == ""
    assert feed(g, 45, 2, items=10, events=10) is not None  # clicks back, but still too thin to judge
    # tripped at 34.9 s; the first judged window since, at 47.9 s (150 items, 28 events), clears it
    assert feed(g, 47, 1, items=100, events=8) is None
    assert g.cleared == "label rate 0.1867 over the last 5s is back at >= 0.5 x its band 0.0800 after 13.0s"


def test_an_outage_longer_than_the_band_holds_until_the_clicks_return():
    cfg = GuardConfig(window_s=5, band_s=300, min_items=100, warmup_items=1000)
    g = InputGuard(cfg)
    assert feed(g, 0, 320, items=100, events=8) is None  # the band: 300 healthy seconds at 8%
    assert feed(g, 320, 5, items=100, events=0) is not None  # the clicks stop: tripped
    for t in range(325, 720):  # 400 s of impressions with no click in all: longer than band_s
        trip = feed(g, t, 1, items=100, events=0)
        assert trip is not None and trip.measure == "label_rate", t
        assert g.band == pytest.approx(0.08), t  # judged against the last healthy band throughout
    assert (g.trips["label_rate"], g.recoveries) == (1, 0)
    assert feed(g, 720, 5, items=100, events=8) is None  # the clicks return
    # tripped at 324.9 s, cleared at 722.9 s: clicks in half the window's seconds, 0.5 x the band
    assert g.cleared == "label rate 0.0400 over the last 5s is back at >= 0.5 x its band 0.0800 after 398.0s"
    # the outage did not become the band: clicks that stop again trip again
    assert feed(g, 725, 10, items=100, events=0) is not None
    assert (g.trips["label_rate"], g.recoveries) == (2, 1) and g.band == pytest.approx(0.08)


def test_nothing_is_judged_while_warming_up_or_over_a_thin_window():
    g = InputGuard(CFG)
    assert feed(g, 0, 8, items=100, events=0) is None  # 300 items in the band: under the warm-up
    g = InputGuard(CFG)
    feed(g, 0, 30, items=100, events=8)
    assert feed(g, 30, 10, items=10, events=0) is None  # 50 items a window: under min_items


def test_a_partition_whose_events_trail_trips_the_lag_guard():
    g = InputGuard(CFG)
    feed(g, 0, 30, items=100, events=8, lag=2.0)
    trip = feed(g, 30, 2, items=100, events=8, lag=45.0)
    assert trip is not None and trip.measure == "event_lag" and "45.0s" in trip.reason
    assert feed(g, 32, 2, items=100, events=8, lag=3.0) is None
    assert g.cleared == "no partition's newest event trails its newest impression by more than 30s after 2.0s"


def test_a_slot_that_goes_empty_trips():
    g = InputGuard(CFG)
    feed(g, 0, 30, items=100, events=8, empty=[0, 5, 0])
    trip = feed(g, 30, 5, items=100, events=8, empty=[0, 5, 100])  # slot 2 lost its feature job
    assert trip is not None and trip.measure == "empty_slot" and "slot 2" in trip.reason


@pytest.mark.parametrize(
    ("kw", "why"),
    [({"window_s": 0}, "window_s must be > 0"), ({"window_s": 400}, "under band_s"),
     ({"low": 0.6, "clear": 0.5}, "low <= clear"), ({"max_lag_s": 0}, "max_lag_s")],
)  # fmt: skip
def test_bad_thresholds_are_refused_by_name(kw, why):
    with pytest.raises(ValueError, match=why):
        GuardConfig(**kw)
