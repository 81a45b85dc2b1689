import numpy as np
import pytest

from tests.loadtest.conftest import has


@pytest.mark.slow
def test_bench_soak_reports_every_window_and_counts_samples_across_the_kills(bench, trained):
    result = bench("bench_soak", "soak", "--store", str(trained[0]), timeout_s=600)
    has(
        result, "minutes", "lost_samples", "duplicate_samples", "windows", "kills", "conditions", "rss_growth"
    )
    assert len(result["windows"]) == 3 and [k["name"] for k in result["kills"]] == [
        "trainer",
        "joiner",
        "ps0.1",
    ]
    for w in result["windows"]:
        has(w, "p50_ms", "p99_ms", "failures", "mixed_responses", "event_to_served_s", "rss_mb", "pids", "cpu_pct",
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


def test_rss_growth_compares_each_process_with_itself_not_a_name_across_a_kill():
    from loadtest.soak_figures import rss_growth

    def window(trainer_pids, trainer_mb, joiner_mb, ps_pids):
        return {"pids": {"trainer": trainer_pids, "joiner": [7], "ps0.1": ps_pids, "bench": [1]},
                "rss_mb": {"trainer": trainer_mb, "joiner": joiner_mb, "ps0.1": 64.0, "bench": 100.0}}  # fmt: skip

    windows = [
        window([10], 600.0, 300.0, [20]),
        window([10], 700.0, 330.0, [20]),  # a fresh trainer, settled
        window([10, 11], 720.0, 331.0, [20]),  # killed: its standby (11) takes the name
        window([11], 760.0, 332.0, [20]),  # the standby that took over, its first whole window
        window([11], 790.0, 333.0, [20, 21]),
        window([11], 780.0, 334.0, [21]),  # a PS replica restarted late: one window of its own
    ]
    growth = rss_growth(windows)
    assert set(growth) == {"trainer", "joiner"}  # not the bench's, nor one with a single window
    assert growth["trainer"] == {
        "pids": [11],
        "from_window": 3,
        "from_mb": 760.0,
        "last_mb": 780.0,
        "ratio": 1.026,
    }
    assert growth["joiner"]["from_window"] == 1 and growth["joiner"]["ratio"] == round(334 / 330, 3)
