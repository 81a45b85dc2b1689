import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow  # a process of its own, as every bench's smoke run


def test_bench_join_replays_every_sample_and_reports_its_rate(bench):
    result = bench("bench_join", "join")
    has(result, "samples", "join_samples_per_s", "seconds", "requests", "events", "machine")
    assert result["samples"] == result["requests"] * result["items"] + result["partitions"]
