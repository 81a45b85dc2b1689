import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow  # a process of its own, as every bench's smoke run


def test_bench_trainer_trains_every_sample_and_reports_its_rate_and_lag(bench):
    result = bench("bench_trainer", "trainer")
    has(result, "samples", "train_samples_per_s", "max_lag_samples", "baseline", "trainer", "machine")
    for run in (result["baseline"], result["trainer"]):
        assert run["samples"] == result["samples"] == result["requests"] * result["items"]
        assert run["max_lag_samples"] == result["samples"]  # the whole topic waits at the first look
