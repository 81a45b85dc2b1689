"""The joiner's /metrics: the join's counters and the input guard's state, read from
``JoinCounts`` and the guard at scrape time."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from stream.join import INPUTS, PartitionJoin

if TYPE_CHECKING:
    from stream.joiner import Joiner


class Collector:
    """The join's counters on /metrics."""

    def __init__(self, joiner: Joiner) -> None:
        self.joiner = joiner

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        c = self.joiner.counts
        for name, doc, value in (
            ("impressions", "Impressions read", c.impressions),
            ("events", "Events read", c.events),
            ("duplicate_events", "Events for an item already labelled (collapsed)", c.duplicates),
            ("late_events", "Events past their window or attribution (dropped)", c.late),
            (
                "replayed_events",
                "Events re-read after a restart that were handled before it (not late again)",
                c.replayed,
            ),
            ("samples_acked", "Samples and dead letters the broker acknowledged", c.acked),
            (
                "corrections",
                "Positives after an item's first horizon, within its attribution window",
                c.corrections,
            ),
            (
                "corrections_lost",
                "Corrections whose impression the spill no longer held (dropped)",
                c.corrections_lost,
            ),
        ):
            yield CounterMetricFamily(f"recserve_join_{name}", doc, value=value)
        samples = CounterMetricFamily("recserve_join_samples", "Samples produced, by label", labels=["label"])
        samples.add_metric(["positive"], c.positives)
        samples.add_metric(["negative"], c.negatives)
        yield samples
        dead = CounterMetricFamily("recserve_join_dead_letters", "Malformed input records sent to the dead-letter topic", labels=["input"])  # fmt: skip
        for inp, name in enumerate(INPUTS):
            dead.add_metric([name], c.malformed[inp])
        yield dead
        parts = list(self.joiner.parts.values())
        yield GaugeMetricFamily(
            "recserve_join_open_windows",
            "Impressions whose window is open",
            value=sum(p.open_windows for p in parts),
        )
        yield from _guard_metrics(self.joiner, parts)


def _guard_metrics(joiner: Joiner, parts: list[PartitionJoin]) -> Iterator[Any]:
    """The input guard's state, trips and measures (stream/guard.py)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    g, now = joiner.guard, time.time()
    yield GaugeMetricFamily("recserve_join_guard_tripped", "1 while the input guard holds the join", value=float(g.tripped))  # fmt: skip
    trips = CounterMetricFamily(
        "recserve_join_guard_trips", "Input guard trips, by measure", labels=["measure"]
    )
    for measure, n in g.trips.items():
        trips.add_metric([measure], n)
    yield trips
    yield CounterMetricFamily(
        "recserve_join_guard_recoveries", "Input guard trips that cleared", value=g.recoveries
    )
    yield CounterMetricFamily("recserve_join_quarantined_samples", "Samples sent to the quarantine topic", value=joiner.counts.quarantined)  # fmt: skip
    yield GaugeMetricFamily("recserve_join_held_windows", "Windows past their close the input guard holds open", value=sum(p.held_windows(now) for p in parts))  # fmt: skip
    yield GaugeMetricFamily("recserve_join_label_rate", "Events per impressed item over the guard's window (NaN: not judged)", value=g.rate)  # fmt: skip
    yield GaugeMetricFamily("recserve_join_label_rate_band", "Events per impressed item over the guard's band (NaN: warming up)", value=g.band)  # fmt: skip
    lag = GaugeMetricFamily("recserve_join_event_lag_seconds", "How far the newest event's ts trails the newest impression's", labels=["partition"])  # fmt: skip
    for p in sorted(joiner.parts):
        lag.add_metric([str(p)], joiner.parts[p].event_lag())
    yield lag
