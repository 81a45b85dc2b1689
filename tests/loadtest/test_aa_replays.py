import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow  # a process of its own, as every bench's smoke run


def test_aa_replays_counts_false_decisions_and_the_rules_power(bench):
    result = bench("aa_replays", "aa", "--replays", "4")
    has(result, "replays", "false_promotions", "false_aborts", "false_decision_rate", "samples", "alpha")
    assert result["replays"] == 4 and result["samples"] == 5000 and result["alpha"] == 0.05
    assert result["false_decision_rate"] == (result["false_promotions"] + result["false_aborts"]) / 4
    assert set(result["power"]) == {"better", "worse"}
    assert result["data"]["resampled"] and 0.5 < result["data"]["auc"] < 1
