import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_bench_scale_serves_switches_and_a_delta_from_mapped_versions(bench, tmp_path):
    result = bench("bench_scale", "scale")
    serving = result["serving"]
    has(serving, "serving_rows", "serving_bytes_per_row", "load_s", "switch_s", "lookup_calls", "lookup_failures",
        "lookup_p99_steady_ms", "lookup_p99_during_switch_ms", "lookup_p99_during_release_ms",
        "lookup_p99_idle_spinner_ms", "peak_rss_during_switch_gb", "old_plus_new_gb", "delta_visible_s")  # fmt: skip
    assert serving["serving_rows"] == 20_000 and len(serving["per_switch"]) == 2
    assert serving["peak_rss_during_switch_gb"] > 0  # the sampler saw the PS processes
    has(result, "targets_met", "machine", "bytes_per_row_ratio", "int8", "float16")
    assert set(result["bytes_per_row_ratio"]) == {"float16", "int8"}
    has(result["int8"], "serving_rows", "lookup_p99_ms", "lookup_p99_over_fp32", "colocated_p99_ms", "load_s",
        "fp32_same_window_p99_ms", "lookup_p99_over_fp32_steady")  # fmt: skip
    assert result["int8"]["serving_rows"] == 60_000 and result["int8"]["lookup_failures"] == 0
    # over gRPC an int8 row is its codes + fp16 scale and bias (dim 16: 20 bytes), not 64
    wire = result["int8"]["wire"]
    assert (wire["stored"]["reply_bytes"], wire["float32"]["reply_bytes"]) == (4000 * 20, 4000 * 64)
    assert result["float16"]["wire"]["stored"]["reply_bytes"] == 4000 * 32
    assert set(result["pss_bytes_per_row_ratio"]) == {"float16", "int8", "float32"}
    assert (tmp_path / "results" / "scale.png").exists()
