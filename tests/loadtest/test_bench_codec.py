import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow  # a process of its own, as every bench's smoke run


def test_bench_codec_runs_and_reports_each_workload(bench):
    result = bench("bench_codec", "codec")
    for workload in ("criteo_200", "ranking_80"):
        has(result[workload], "compact_bytes", "naive_bytes", "json_bytes", "encode_us", "decode_us",
            "transform_us", "compact/naive", "json_loads/decode")  # fmt: skip
    has(result, "targets_met", "machine")
