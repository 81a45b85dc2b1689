import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow  # a process of its own, as every bench's smoke run


def test_bench_attribution_corrects_across_a_joiner_sigkill_and_reports_its_memory(bench):
    result = bench("bench_attribution", "attribution")
    has(result, "requests", "first_labels_expected", "lost_samples", "unexpected_samples", "samples_produced_again",
        "clicks_expected", "clicks_labelled_at_once", "corrections", "lost_clicks", "clicks_labelled_twice",
        "unexpected_corrections", "corrections_produced_again", "joiner_rss_mb", "spill_mb_at_end", "killed_at_s",
        "targets_met", "machine")  # fmt: skip
    assert result["corrections"] > 0 and result["killed_at_s"] is not None
    lost = (
        "lost_samples",
        "unexpected_samples",
        "lost_clicks",
        "clicks_labelled_twice",
        "unexpected_corrections",
    )
    assert [result[k] for k in lost] == [0] * len(lost)
    has(result["joiner_rss_mb"], "second_minute", "last", "max")
