import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_bench_stream_trains_every_closed_impression_once_across_the_kills(bench, trained):
    result = bench("bench_stream", "stream", "--store", str(trained[0]), timeout_s=600)
    has(result, "impressions", "samples_joined", "samples_trained", "duplicate_samples", "lost_samples",
        "progressive_auc", "join_samples_per_s", "train_samples_per_s", "max_lag_samples", "event_to_served_s",
        "logging_p99_ratio", "conditions")  # fmt: skip
    assert set(result["progressive_auc"]) == {"streaming", "frozen"}
    assert set(result["back_under_s"]) == set(result["recovery_s"]) == {"trainer", "joiner"}
    assert {"p50", "p99"} <= set(result["event_to_served_s"])
    assert result["impressions"] > 0 and result["samples_trained"] > 0
    assert result["duplicate_samples"] == 0
    assert result["identical_requests"]  # the frozen model's per-item scores stand for every request
    assert result["deltas"]["served_at_end"] > result["deltas"]["served_at_start"]  # deltas reached serving
