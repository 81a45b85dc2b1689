import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_bench_e2e_runs_a_lean_and_a_torchserve_run_with_their_figures(bench):
    result = bench("bench_e2e", "e2e")
    has(result, "inprocess_p50_ms", "runs", "targets_met", "conditions")
    runs = result["runs"]
    served = [(r["frontend"], r["lookups"], r["form"]) for r in runs]
    assert sorted(served) == sorted(
        (f, lookups, form) for f, lookups in (("lean", "colocated"), ("torchserve", "remote"))
        for form in ("records", "columns")
    ), served  # fmt: skip
    lean = next(r for r in runs if r["frontend"] == "lean")
    ts = next(r for r in runs if r["frontend"] == "torchserve")
    for run in runs:
        has(run, "max_rps_p99_le_10ms", "stages_ms")
        has(run["rates"]["10"], "p50_ms", "p99_ms", "requests", "failures", "server_timing_p50_ms",
            "cpu_ms_per_request")  # fmt: skip
    # the process sampler found each process: the lean frontend, TorchServe's handler workers
    assert lean["rates"]["10"]["cpu_ms_per_request"]["lean"] > 0
    assert ts["rates"]["10"]["cpu_ms_per_request"]["handler"] > 0
    has(
        ts["stages_ms"],
        "decode",
        "dense",
        "worker_forward_rpc",
        "encode_response",
        "inprocess_paced_10rps",
    )
