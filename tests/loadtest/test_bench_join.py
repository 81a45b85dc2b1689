import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow  # a process of its own, as every bench's smoke run


def test_bench_join_replays_every_sample_and_reports_its_rate(bench):
    result = bench("bench_join", "join")
    has(result, "samples", "samples_per_s", "joiner_cpu_us_per_sample", "seconds", "targets_met")
    has(result, "requests", "events", "machine")
    assert result["samples"] == result["requests"] * result["items"] + result["partitions"]
