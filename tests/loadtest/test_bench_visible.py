import pytest

from loadtest import netns
from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_bench_visible_measures_every_process_in_each_mode(bench, trained):
    if netns.unavailable():
        pytest.skip(f"multi-host bench: {netns.unavailable()}")
    result = bench("bench_visible", "visible", "--store", str(trained[0]), timeout_s=600)
    has(result, "delta_visible_s", "modes", "targets_met")
    assert set(result["modes"]) == {"kafka", "poll"}
    for mode in result["modes"].values():
        has(
            mode,
            "delta_visible_s",
            "per_process_p99_s",
            "notices_received",
            "responses_checked",
            "responses_at_seq",
        )
        assert mode["deltas"] == 3 and len(mode["per_process_p99_s"]) == 6
        assert mode["responses_at_seq"] == mode["responses_checked"] == 6  # each frontend answered from it
    assert all(
        n >= 3 for n in result["modes"]["kafka"]["notices_received"].values()
    )  # every process, every notice
