import numpy as np
import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow  # a process of its own, as every bench's smoke run


def test_bench_attribution_corrects_across_a_joiner_sigkill_and_reports_its_memory(bench):
    result = bench("bench_attribution", "attribution")
    has(result, "requests", "first_labels_expected", "lost_samples", "unexpected_samples", "samples_produced_again",
        "clicks_expected", "clicks_labelled_at_once", "corrections", "lost_clicks", "clicks_labelled_twice",
        "unexpected_corrections", "corrections_produced_again", "joiner_rss_mb", "spill_mb_at_end", "killed_at_s",
        "lost_click_examples", "dead_letters",
        "targets_met", "machine")  # fmt: skip
    has(result["dead_letters"], "impressions.dead", "events.dead", "reasons")
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


def test_bench_attribution_counts_what_a_sigkilled_trainer_trained(bench, trained):
    result = bench("bench_attribution", "attribution", "--trainer", "--store", str(trained[0]), timeout_s=600)
    t = result["trainer"]
    has(t, "samples_trained", "deltas", "duplicate_samples", "lost_samples", "killed_at_s",
        "dropped_by_the_broker_before_trained")  # fmt: skip
    assert t["killed_at_s"] is not None and t["deltas"] > 1
    assert (t["duplicate_samples"], t["lost_samples"]) == (0, 0)
    assert t["samples_trained"] == result["first_labels_expected"] + result["corrections"]


def test_each_delta_is_held_to_the_new_keys_first_placed_in_it():
    from types import SimpleNamespace

    from loadtest.bench_attribution import trained

    # partition 0: keys 1, 2, 3, 1 (re-sent) at offsets 0-3; partition 1: keys 4, 5 at 0-1
    codes = np.array([1, 2, 3, 1, 4, 5])
    where = np.array([[0, 0], [0, 1], [0, 2], [0, 3], [1, 0], [1, 1]])

    def deltas(*said):
        return [SimpleNamespace(positions={"samples/0": p0, "samples/1": p1}, samples=n)
                for (p0, p1), n in zip([(2, 1), (4, 2)][: len(said)], said, strict=True)]  # fmt: skip

    assert trained(codes, where, deltas(3, 2), 2) == {"samples_trained": 5, "deltas": 2, "duplicate_samples": 0, "lost_samples": 0}  # fmt: skip
    assert trained(codes, where, deltas(3, 3), 2)["duplicate_samples"] == 1  # key 1 trained again
    assert trained(codes, where, deltas(3, 1), 2)["lost_samples"] == 1
    assert trained(codes, where, deltas(3), 2)["lost_samples"] == 2  # keys 3 and 5 never reached


def test_the_clicks_no_positive_came_out_for_are_named():
    from loadtest.bench_attribution import lost_clicks

    imp_ts = np.array([100.0, 101.0])
    clicks = (np.array([0, 1, 1]), np.array([3, 5, 5]), np.array([100.5, 131.0, 140.0]))  # request, item, ts
    clicked = np.array([(0 << 33) + 3 * 2, (1 << 33) + 5 * 2])
    codes = np.array([(0 << 33) + 3 * 2, (1 << 33) + 5 * 2])  # both items' first labels: 0's positive
    dead = {"0000000001": "event: no impression of request '0000000001' in the 7200 s before it"}
    got = lost_clicks(codes, np.array([True, False]), clicked, clicks, imp_ts, label_after_s=5.0, dead=dead)
    assert got == [{"request": 1, "item": 5, "impression_s": 1.0, "delay_s": 30.0, "after_first_horizon": True,
                    "dead_letter": dead["0000000001"]}]  # fmt: skip
