import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_bench_scale_train_runs_both_sizes_and_the_readers(bench):
    result = bench("bench_scale_train", "scale_train")
    has(result, "train_peak_rss_gb_1x", "train_peak_rss_gb_10x", "rss_ratio_10x", "trainer_peak_rss_gb_10x",
        "trainer_rss_ratio_10x", "ps_rows_10x", "train_samples_per_s", "test_auc", "read_rows_per_s",
        "read_rows_per_s_1proc", "reader_baseline_s", "reader_baseline_peak_rss_gb", "targets", "conditions")  # fmt: skip
    # the sampler saw the trainer's PS shard processes: the tree holds more than the trainer alone
    assert result["train_peak_rss_gb_10x"] > result["trainer_peak_rss_gb_10x"] > 0.05, result
    assert result["conditions"]["rows_1x"] == 2000
