import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_bench_e2e_runs_a_lean_and_a_torchserve_run_with_their_figures(bench):
    result = bench("bench_e2e", "e2e")
    has(result, "inprocess_p50_ms", "runs", "targets_met", "conditions")
    runs = result["runs"]
    assert [(r["frontend"], r["lookups"]) for r in runs] == [("lean", "colocated"), ("torchserve", "remote")]
    for run in runs:
        has(run, "max_rps_p99_le_10ms", "stages_ms")
        has(run["rates"]["10"], "p50_ms", "p99_ms", "requests", "failures", "server_timing_p50_ms",
            "cpu_ms_per_request")  # fmt: skip
    # the process sampler found each process: the lean frontend, TorchServe's handler workers
    assert runs[0]["rates"]["10"]["cpu_ms_per_request"]["lean"] > 0
    assert runs[1]["rates"]["10"]["cpu_ms_per_request"]["handler"] > 0
    has(
        runs[1]["stages_ms"],
        "decode",
        "dense",
        "worker_forward_rpc",
        "encode_response",
        "inprocess_paced_10rps",
    )
