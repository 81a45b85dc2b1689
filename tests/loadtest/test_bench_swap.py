import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_bench_swap_runs_deltas_and_a_full_switch_under_load(bench, tmp_path):
    # int8 versions and deltas: the float32 swap path is what every other serving test runs
    result = bench("bench_swap", "swap", "--serving-dtype", "int8")
    (run,) = result["runs"]
    assert (run["serving_dtype"], run["lookups"], run["round"]) == ("int8", "colocated", 0)
    assert run["conditions"]["serving_dtype"] == "int8"
    assert run["failures"] == 0 and run["mixed_responses"] == 0
    has(run, "p50_steady_ms", "p99_steady_ms", "p50_during_swap_ms", "p99_during_swap_ms", "p99_ratio",
        "first_delta_p99_ms", "full_switch_window_s", "delta_visible_p50_s", "delta_visible_p99_s",
        "delta_ps_live_p99_s", "stages", "per_event", "placebo_deltas_ratio")  # fmt: skip
    assert run["placebo_deltas_ratio"]["draws"] > 0  # the noise the deltas' ratio is compared with
    assert [e["kind"] for e in run["events"]] == [
        "delta",
        "delta",
        "full version switch",
        "dense version switch",
        "old dense version retired",
    ]
    # one row per event, with the handler's stage times (Server-Timing) of its requests
    assert [row["event"] for row in run["per_event"]] == [
        "delta 0", "delta 1", "full version switch", "dense version switch", "old dense version retired"
    ]  # fmt: skip
    assert run["per_event"][0]["requests"] > 0 and run["per_event"][0]["worker_max_ms"] > 0
    # a delta's window lasts until the responses read it
    assert all(e["end"] >= max(e["live"], e["applied"]) for e in run["events"] if e["kind"] == "delta")
    assert result["summary"]["int8"]["colocated"]["rounds"] == 1
    assert (tmp_path / "results" / "swap-colocated-int8-0.png").exists()
