import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_bench_swap_runs_deltas_and_a_full_switch_under_load_behind_serves_workers(bench, tmp_path):
    # int8 versions and deltas: the float32 swap path is what every other serving test runs
    result = bench("bench_swap", "swap", "--serving-dtype", "int8", "--workers", "2")
    (run,) = result["runs"]
    assert (run["serving_dtype"], run["lookups"], run["round"]) == ("int8", "colocated", 0)
    assert run["conditions"]["serving_dtype"] == "int8"
    assert (run["conditions"]["frontend"], run["conditions"]["workers"]) == ("serve", 2)
    assert run["failures"] == 0 and run["mixed_responses"] == 0
    has(run, "p50_steady_ms", "p99_steady_ms", "p50_during_swap_ms", "p99_during_swap_ms", "p99_ratio",
        "first_delta_p99_ms", "full_switch_window_s", "delta_visible_p50_s", "delta_visible_p99_s",
        "delta_ps_live_p99_s", "stages", "per_event", "placebo_deltas_ratio", "per_process")  # fmt: skip
    assert run["placebo_deltas_ratio"]["draws"] > 0  # the noise the deltas' ratio is compared with
    # co-located behind recserve serve: no PS shard; every worker applies the deltas and switches
    assert [e["kind"] for e in run["events"]] == ["delta", "delta", "frontend version switch"]
    assert [row["event"] for row in run["per_event"]] == ["delta 0", "delta 1", "frontend version switch"]
    assert run["per_event"][0]["requests"] > 0 and run["per_event"][0]["worker_max_ms"] > 0
    # a delta's window lasts until the responses read it; the switch until every worker drained v1
    assert all(e["end"] >= max(e["live"], e["applied"]) for e in run["events"])
    # each response names its worker: both answered, and each read every delta
    workers = run["per_process"]
    assert len(workers) == 2 and all(int(pid) > 0 for pid in workers)
    assert all(w["requests"] > 0 and w["mixed_responses"] == 0 for w in workers.values())
    assert all(w["delta_visible_p99_s"] is not None for w in workers.values())
    assert result["summary"]["int8"]["colocated"]["rounds"] == 1
    assert (tmp_path / "results" / "swap-colocated-int8-0.png").exists()


def test_bench_swap_behind_torchserve_times_the_controllers_dense_switch(bench):
    result = bench("bench_swap", "swap", "--frontend", "torchserve")
    (run,) = result["runs"]
    assert run["conditions"]["frontend"] == "torchserve"
    assert run["failures"] == 0 and run["mixed_responses"] == 0
    assert [row["event"] for row in run["per_event"]] == [
        "delta 0", "delta 1", "full version switch", "dense version switch", "old dense version retired"
    ]  # fmt: skip
    assert list(run["per_process"]) == ["-1"]  # TorchServe's responses name no process
