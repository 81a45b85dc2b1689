"""What each follower last made visible, as a fact on /metrics: ``recserve_delta_visible_seconds``
{component, shard, version, seq} is, per shard a process follows, the last delta it applied and
the seconds from that delta's ``_SUCCESS`` to the flip that put it in lookups (``Follower.visible``);
``recserve_delta_apply_slot_timeouts_total`` {component, shard} counts the passes that applied
deltas without a turn, no apply slot having come free (``Follower.slot_timeouts``, serving/ps/follow.py).
A PS shard reports its one shard; a scoring frontend each co-located shard of the version it serves.
``loadtest/bench_visible.py`` reads it from every serving process."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

VISIBLE = "recserve_delta_visible_seconds"
SLOT_TIMEOUTS = "recserve_delta_apply_slot_timeouts"


class VisibleCollector:
    """A Prometheus collector over ``followers()``: (shard, ``Follower``) pairs, read at scrape time."""

    def __init__(self, component: str, followers: Callable[[], Iterable[tuple[int, Any]]]):
        self.component, self.followers = component, followers

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        g = GaugeMetricFamily(VISIBLE, "Seconds from the last applied delta's _SUCCESS to its flip into lookups",
                              labels=["component", "shard", "version", "seq"])  # fmt: skip
        c = CounterMetricFamily(SLOT_TIMEOUTS, "Delta passes applied without a turn: no host apply slot came free in time",
                                labels=["component", "shard"])  # fmt: skip
        for shard, follower in self.followers():
            seq, lag = follower.visible  # one tuple: seq and lag of the same delta
            if seq >= 0:
                g.add_metric([self.component, str(shard), follower.store.version, str(seq)], lag)
            c.add_metric([self.component, str(shard)], follower.slot_timeouts)
        yield g
        yield c


def follow_notices(spec: str, model_dir: str, registry, component: str,
                   followers: Callable[[], Iterable[tuple[int, Any]]]):  # fmt: skip
    """A serving process's ``serving.notices.Notices`` over ``spec`` (None: the poll alone), with its
    followers' visibility (``VisibleCollector``) and the notices counted in ``registry``."""
    from serving.notices import open_notices

    if registry is not None:
        registry.register(VisibleCollector(component, followers))
    return open_notices(spec, model_dir, registry)
