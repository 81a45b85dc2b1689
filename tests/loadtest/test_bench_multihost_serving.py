"""``make bench-multihost``'s serving half (``--only serving``; its training half is
test_bench_multihost_training.py, so that the two can run side by side)."""

import pytest

from loadtest import netns
from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_bench_multihost_serving_half_runs_across_namespace_hosts(bench):
    if reason := netns.unavailable():
        pytest.skip(f"bench-multihost needs network namespaces: {reason}")
    result = bench("bench_multihost", "multihost", "--only", "serving")
    has(result["serving"], "failures_host_down", "failures_worker_down", "mixed_responses", "failures_switch",
        "p99_ms_across_hosts", "p99_ms_one_host", "requests")  # fmt: skip
    has(result, "targets_met", "quick")
