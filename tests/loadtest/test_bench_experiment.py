import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_bench_experiment_runs_the_experiment_and_writes_every_figure(bench, trained):
    result = bench("bench_experiment", "experiment", "--store", str(trained[0]), timeout_s=600)
    has(result, "decisions", "samples_to_decision", "metric_max_abs_diff", "mixed_responses", "units_in_two_arms",
        "split_p99_ratio", "aa_replays", "aa_false_decision_rate", "conditions")  # fmt: skip
    assert set(result["decisions"]) == {"A", "B"}
    assert result["mixed_responses"] == 0 and result["units_in_two_arms"] == 0
    assert result["aa_replays"] >= 50
    assert set(result["split_p99"]) == {"lean", "torchserve"}
    for side in result["split_p99"].values():  # the bench's own noise beside each ratio
        assert set(side["halves"]) == set(side["rounds_p99_ms"]) == {"with", "without"}
