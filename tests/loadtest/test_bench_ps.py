import shutil

import pytest

from tests.loadtest.conftest import has

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which("redis-server") is None,
        reason="bench-ps compares with redis-server (make bench-ps installs it)",
    ),
]


def test_bench_ps_runs_the_ps_against_redis(bench):
    result = bench("bench_ps", "ps")
    has(result, "grpc_lookup_500_p50_ms", "grpc_lookup_4000_p50_ms", "grpc_lookup_4000_p99_ms",
        "redis_mget_4000_p50_ms", "redis_mget_4000_p99_ms", "grpc_vs_redis_4000_p50", "bytes_per_row", "bytes_vs_raw",
        "inproc_ids_per_s", "ps_start_and_load_s", "runs", "targets")  # fmt: skip
    assert result["rows"] == 20_000 and result["client_iters"] == 50
    assert result["same_rows_grpc_redis"] is True
