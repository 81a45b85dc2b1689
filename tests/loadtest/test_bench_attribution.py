import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow  # a process of its own, as every bench's smoke run


def test_bench_attribution_corrects_across_a_joiner_sigkill_and_reports_its_memory(bench):
    result = bench("bench_attribution", "attribution")
    has(result, "requests", "first_labels_expected", "corrections_expected", "lost_samples", "lost_corrections",
        "samples_produced_again", "corrections_produced_again", "unexpected_samples", "joiner_rss_mb",
        "spill_mb_at_end", "killed_at_s", "targets_met", "machine")  # fmt: skip
    assert result["corrections_expected"] > 0 and result["killed_at_s"] is not None
    assert (result["lost_samples"], result["lost_corrections"], result["unexpected_samples"]) == (0, 0, 0)
    has(result["joiner_rss_mb"], "second_minute", "last", "max")
