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
        has(mode, "delta_visible_s", "notice_s", "per_process_p99_s", "notices_received", "responses_checked",
            "responses_at_seq")  # fmt: skip
        assert mode["deltas"] == 3 and len(mode["per_process_p99_s"]) == 6, mode
        # each frontend's response named the delta its /metrics reported
        assert mode["responses_at_seq"] == mode["responses_checked"] == 6, mode
    kafka = result["modes"]["kafka"]
    assert all(n == 3 for n in kafka["notices_received"].values()), kafka  # every process, every notice
    assert kafka["notices_heard_everywhere"] == 3, kafka
    assert result["modes"]["poll"]["notice_s"]["p50"] is None, result
