"""One /metrics for a frontend of several processes (serving/scoring/multiproc.py): collected
counters summed over live and dead workers, gauges over live ones (listening: the least), a file
read back as written; and the roster a frontend's processes keep (serving/scoring/roster.py)."""

from __future__ import annotations

import os

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from serving.notices.metrics import LISTENING
from serving.scoring import multiproc, roster


def _process(logged: float, listening: float, lag: float) -> list:
    counter = CounterMetricFamily("recserve_impressions_logged", "logged", labels=["topic"])
    counter.add_metric(["imp"], logged)
    listen = GaugeMetricFamily(LISTENING, "listening", labels=["transport"])
    listen.add_metric(["inotify"], listening)
    return [counter, listen, GaugeMetricFamily("recserve_notice_lag_seconds", "lag", value=lag)]


def _values(families: list) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families for s in f.samples}


def test_counters_sum_over_every_process_and_gauges_over_the_live_ones():
    merged = _values(multiproc.merge([_process(3, 1, 0.2), _process(4, 0, 0.5)], [_process(5, 1, 9.0)]))
    assert merged == {
        ("recserve_impressions_logged_total", (("topic", "imp"),)): 12,  # the dead worker's 5 stay
        (LISTENING, (("transport", "inotify"),)): 0,  # not every worker listens
        ("recserve_notice_lag_seconds", ()): 0.5,  # the greatest of the live ones
    }


def test_a_collected_file_reads_back_as_written_and_a_dead_one_still_counts(tmp_path):
    multiproc.write_collected(tmp_path, _process(2, 1, 0.1), pid=11)
    multiproc.write_collected(tmp_path, _process(3, 1, 0.1), pid=12)
    multiproc.mark_dead(tmp_path, 12)
    collected = multiproc.Collected(tmp_path, lambda: _process(1, 1, 0.3))
    assert _values(collected.collect()) == {
        ("recserve_impressions_logged_total", (("topic", "imp"),)): 6,
        (LISTENING, (("transport", "inotify"),)): 1,
        ("recserve_notice_lag_seconds", ()): 0.3,
    }
    assert _values(multiproc.read_collected(tmp_path / "collected-11.json")) == _values(_process(2, 1, 0.1))


def test_the_roster_lists_fresh_records_and_forgets_stale_and_removed_ones(tmp_path):
    fresh = roster.FrontendRecord(os.getpid(), 7, "127.0.0.1:8080", version="1", deltas=[3, 3],
                                  lookups=["colocated", "colocated"])  # fmt: skip
    roster.write(tmp_path, fresh)
    roster.write(tmp_path, roster.FrontendRecord(99, 7, "127.0.0.1:8080", updated=fresh.updated - 60))
    assert roster.read(tmp_path) == [fresh]
    assert fresh.line() == (
        f"  127.0.0.1:8080  pid {os.getpid()} (worker of 7)  version 1 delta 3  lookups colocated,colocated"
    )
    roster.remove(tmp_path, os.getpid())
    assert roster.read(tmp_path) == []
