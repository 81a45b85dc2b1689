import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_bench_guard_trips_both_guards_and_writes_every_figure(bench, trained):
    result = bench("bench_guard", "guard", "--store", str(trained[0]), timeout_s=600)
    has(result, "outage", "bad_labels", "guard_events", "conditions")
    has(result["outage"], "trip_s", "served_mean_ratio_min", "deltas_served_from_outage", "lost_samples",
        "quarantined", "resumed")  # fmt: skip
    has(result["bad_labels"], "trip_s", "rollback_s", "auc_before", "auc_after")
    events = {(e["guard"], e["event"]) for e in result["guard_events"]}
    assert ("input", "trip") in events and ("input", "clear") in events  # both outages seen and cleared
    assert result["outage"]["trip_s"] is not None and result["outage"]["quarantined"] > 0
    # (--quick's 15 s join window is about three trips long: whether an outage's first requests
    # close before the trip is timing; tests/stream/test_joiner_guard.py holds the property)
