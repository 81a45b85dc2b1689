import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_bench_stream_trains_every_closed_impression_once_across_the_kills(bench):
    result = bench("bench_stream", "stream", timeout_s=600)
    has(result, "impressions", "samples_joined", "samples_trained", "duplicate_samples", "lost_samples",
        "progressive_auc", "join_samples_per_s", "train_samples_per_s", "max_lag_samples", "conditions")  # fmt: skip
    assert set(result["progressive_auc"]) == {"streaming", "frozen"}
    assert result["impressions"] > 0 and result["samples_trained"] > 0
    assert result["duplicate_samples"] == 0
