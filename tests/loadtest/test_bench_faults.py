import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_bench_faults_runs_every_kill_and_the_fuzz(bench):
    result = bench("bench_faults", "faults")
    has(result, "failures_with_replicas", "failures_worker_kill", "failures_controller_kill", "ps_recovery_s",
        "worker_recovery_s", "controller_recovery_s", "lost_deltas", "fuzz_cases", "fuzz_server_errors",
        "scores_unchanged_by_fuzz", "restarts", "targets_met")  # fmt: skip
    assert [e["name"] for e in result["events"]] == ["ps0.1", "worker", "controller"]
    assert result["fuzz_cases"] == 400
