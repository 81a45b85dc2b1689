import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_bench_swap_runs_deltas_and_a_full_switch_under_load(bench, tmp_path):
    # int8 versions and deltas: the float32 swap path is what every other serving test runs
    result = bench("bench_swap", "swap", "--serving-dtype", "int8")
    (run,) = result["runs"]
    assert run["conditions"]["serving_dtype"] == "int8"
    assert run["failures"] == 0 and run["mixed_responses"] == 0
    has(run, "lookups", "failures", "mixed_responses", "p99_steady_ms", "p99_during_swap_ms", "full_switch_window_s",
        "delta_visible_p50_s", "delta_visible_p99_s", "delta_ps_live_p99_s", "windows")  # fmt: skip
    assert [e["kind"] for e in run["events"]] == [
        "delta",
        "delta",
        "full version switch",
        "dense version switch",
    ]
    assert (tmp_path / "results" / "swap-colocated.png").exists()
