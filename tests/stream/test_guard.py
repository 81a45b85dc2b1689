"""The input guard alone (no Kafka): it trips when the label rate falls under its band, when a
partition's events trail its impressions, and when a slot goes empty; it clears when the measure
is back, saying why (or that nothing was left to judge); nothing is judged while it warms up or
over a thin window, and a tripped stretch never becomes the band."""

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


def test_a_trip_whose_window_thins_out_clears_saying_nothing_was_judged():
    g = InputGuard(CFG)
    feed(g, 0, 30, items=100, events=8)
    assert feed(g, 30, 5, items=100, events=0) is not None
    assert feed(g, 35, 6, items=10, events=0) is None  # 60 items a window: under min_items
    why = (
        "nothing judged: 60 items over the last 5s and 2900 in its band (judged from 100 and 1000) after 6.0s"
    )
    assert g.cleared == why


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
