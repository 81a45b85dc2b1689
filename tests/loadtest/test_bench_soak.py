import numpy as np
import pytest

from tests.loadtest.conftest import has


@pytest.mark.slow
def test_bench_soak_reports_every_window_and_counts_samples_across_the_kills(bench, trained):
    result = bench("bench_soak", "soak", "--store", str(trained[0]), timeout_s=600)
    has(result, "minutes", "lost_samples", "duplicate_samples", "windows", "kills", "conditions")
    assert len(result["windows"]) == 3 and [k["name"] for k in result["kills"]] == [
        "trainer",
        "joiner",
        "ps0.1",
    ]
    for w in result["windows"]:
        has(w, "p50_ms", "p99_ms", "failures", "mixed_responses", "event_to_served_s", "rss_mb", "cpu_pct",
            "store_bytes", "torchserve")  # fmt: skip
        assert w["requests"] > 0 and w["torchserve"]["requests"] > 0
        assert {"lean", "torchserve", "trainer", "joiner", "ps0.0", "ps0.1"} <= set(w["rss_mb"])
        assert set(w["cpu_pct"]) <= set(w["rss_mb"]) and w["cpu_pct"]["lean"] > 0  # it served
        assert w["store_bytes"] > 0
    assert result["samples_trained"] > 0 and result["duplicate_samples"] == 0
    assert sum(w["clicks"] for w in result["windows"]) > 0  # served or not: a loaded machine may be slow
    assert all(set(w["event_to_served_s"]) == {"p50", "p99", "over_2s"} for w in result["windows"])
    for span in (s for w in result["windows"] for s in w["event_to_served_s"]["over_2s"]):
        assert span[0] <= span[1] and span[2] >= 1


def test_spans_group_times_within_the_gap():
    from loadtest.soak_figures import spans

    assert spans(np.array([])) == []
    assert spans(np.array([10.0, 3.0, 3.5, 11.0, 30.0])) == [[3.0, 3.5, 2], [10.0, 11.0, 2], [30.0, 30.0, 1]]
