import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_bench_e2e_runs_a_lean_and_a_torchserve_run_one_and_two_workers_and_an_open_loop(bench, trained):
    result = bench("bench_e2e", "e2e", "--store", str(trained[0]))
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

    check_workers_and_open_loop(result)


def check_workers_and_open_loop(result: dict) -> None:
    """``recserve serve --workers 1`` and ``--workers 2`` (token auth on) and the open loop."""
    has(result, "workers", "open_loop")
    workers = result["workers"]
    has(workers, "1", "2", "ratio", "pss_ratio", "frontend_pss_ratio")
    for n in (1, 2):
        run = workers[str(n)]
        has(run, "max_rps", "max_rps_by_form", "cpu_ms_per_request", "pss_mb", "rss_mb", "forms")
        assert run["processes"] == (1 if n == 1 else 3)  # two workers and their parent
        assert len(run["pss_mb"]["workers"]) == n and all(0 < mb < 2000 for mb in run["pss_mb"]["workers"])
        assert (run["pss_mb"]["parent"] is None) == (n == 1)
        assert set(run["forms"]) == {"records", "columns"}
        for form in run["forms"].values():  # --quick: 50 requests/s, token auth on
            r = form["50"]
            assert r["requests"] > 0 and r["failures"] == 0, r
            assert r["cpu_ms_per_request"]["lean"] > 0  # the frontend's processes were found
    assert workers["pss_ratio"] < workers["frontend_pss_ratio"]  # the parent's share is extra
    assert result["conditions"]["token_auth"] == {"runs": False, "workers": True, "open_loop": True}
    for rate in ("10", "50"):
        r = result["open_loop"][rate]
        has(r, "p50_ms", "p99_ms", "requests", "failures")
        assert r["requests"] > 0 and r["failures"] == 0 and r["p50_ms"] <= r["p99_ms"]
