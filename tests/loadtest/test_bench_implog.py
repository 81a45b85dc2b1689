import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_bench_implog_loads_the_frontend_with_the_log_off_and_on(bench, trained):
    result = bench("bench_implog", "implog", "--store", str(trained[0]))
    has(result, "logging_p99_ratio", "p99_ms", "runs", "impressions", "targets_met", "conditions")
    assert [len(result["runs"][side]) for side in ("off", "on")] == [1, 1]
    imp = result["impressions"]
    assert imp["logged"] + imp["dropped"] == imp["requests_logged_side"] > 0  # every request, once
