import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow

ARMS = {"drop_late", "wait_all", "correct_fnw", "correct_esdfm"}


def test_bench_delayed_runs_every_arm_over_one_world_and_counts_each_sample_and_correction_once(bench):
    result = bench("bench_delayed", "delayed", timeout_s=900)
    has(result, "arms", "joiner_rss_mb", "lost_samples", "duplicate_samples", "conditions", "targets_met")
    assert set(result["arms"]) == ARMS
    for name, arm in result["arms"].items():
        has(arm, "auc", "logloss", "calibration", "event_to_served_s", "joiner_rss_mb", "lost_samples",
            "duplicate_samples", "samples_trained", "corrections_trained")  # fmt: skip
        assert {"p50", "p99"} <= set(arm["event_to_served_s"]), name
        assert arm["samples_trained"] > 0, name
        assert arm["duplicate_samples"] == 0, name
    assert set(result["joiner_rss_mb"]) == {"second_minute", "last", "max"}
    arms = result["arms"]
    assert arms["drop_late"]["corrections_trained"] == 0 and arms["wait_all"]["corrections_trained"] == 0
    assert arms["correct_fnw"]["corrections_trained"] > 0  # late clicks came back as corrections
    assert arms["drop_late"]["joiner"]["late_events"] > 0  # and were dropped without --attribution-s


@pytest.mark.parametrize("ctr", [0.03, 0.1])
def test_the_start_model_trains_on_criteo_with_its_clicks_thinned_to_the_worlds_rate(tmp_path, ctr):
    from loadtest.bench_delayed import at_click_rate
    from loadtest.common import CRITEO_TRAIN

    rows = at_click_rate(CRITEO_TRAIN, tmp_path / "thin.tsv", ctr).read_bytes().splitlines()
    labels = [r[:1] for r in rows]
    negatives = sum(1 for line in CRITEO_TRAIN.read_bytes().splitlines() if line[:1] == b"0")
    assert labels.count(b"0") == negatives  # every negative kept
    assert labels.count(b"1") / len(rows) == pytest.approx(ctr, abs=0.01)
