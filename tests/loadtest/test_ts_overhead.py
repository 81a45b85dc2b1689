import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_ts_overhead_times_starts_and_a_setting_sequentially_and_at_a_rate(bench):
    result = bench("ts_overhead", "ts_overhead")
    has(result, "start_to_healthy_s", "settings", "best_p99_at_rate", "machine")
    setting = result["settings"]["bs1_w1"]
    has(setting["sequential"], "p50_ms", "p99_ms", "requests", "failures")
    has(setting["rate"], "p50_ms", "p99_ms", "achieved_rps", "failures", "service")
    assert setting["sequential"]["requests"] == 20 and setting["sequential"]["failures"] == 0
    has(result["machine"], "cpus", "loadavg_before", "loadavg_after")
