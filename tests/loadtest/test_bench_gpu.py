"""``make bench-gpu``: without CUDA it says why and exits 0 writing nothing; its CPU rehearsal
(``--rehearse-cpu --quick``) runs every section and writes gpu-rehearsal.json with the figures
the GPU run reports."""

import json
import os
import shlex
import subprocess
import sys

import pytest

from loadtest.bench_gpu import DENSE_RUNTIMES
from tests.cuda import without_cuda
from tests.helpers import doc_blocks
from tests.loadtest.conftest import ROOT, has

pytestmark = pytest.mark.slow


@without_cuda
def test_without_cuda_it_says_why_and_writes_nothing(tmp_path):
    done = subprocess.run([sys.executable, "-m", "loadtest.bench_gpu", "--results-dir", str(tmp_path)],
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "bench-gpu: skipped: torch sees no CUDA device" in done.stdout and "nothing written" in done.stdout
    assert not any(tmp_path.iterdir())


def test_the_cpu_rehearsal_runs_every_section(tmp_path):
    """The line docs/benchmarks.md prints, as printed (its results in the test's directory)."""
    [line] = [line for block in doc_blocks("docs/benchmarks.md", "The dense half on a GPU") for line in block]
    argv = shlex.split(line)
    assert argv[:3] == ["python", "-m", "loadtest.bench_gpu"] and "--quick" in argv
    done = subprocess.run([sys.executable, *argv[1:], "--results-dir", str(tmp_path)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, (
        f"{line} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    assert not (tmp_path / "gpu.json").exists()  # a rehearsal never stands in for a GPU's figures
    result = json.loads((tmp_path / "gpu-rehearsal.json").read_text())
    assert result["rehearsal"] is True and result["card"]["name"].startswith("none")
    has(result, "dense", "lean", "train", "targets_met", "wall_s", "machine")
    rows = {(r["runtime"], r["batch"]): r for r in result["dense"]["rows"]}
    assert set(rows) == {(name, batch) for name in DENSE_RUNTIMES for batch in (200, 2048)}
    for row in rows.values():
        has(row, "p50_ms", "p99_ms")
        assert row["ran_on"] == "cpu"
    lean = result["lean"]
    for device in ("cpu", "cuda"):
        has(lean[device], "rates", "max_rps_p99_le_10ms", "ran_on")
        assert set(lean[device]["rates"]) == {f"{r:g}" for r in lean["rates"]}
        for r in lean[device]["rates"].values():
            has(r, "p50_ms", "p99_ms", "failures", "achieved_rps")
            assert r["failures"] == 0
    assert lean["cpu"]["devices"] == ["cpu"] and lean["cpu"]["runtime"]  # what /metrics said
    runs = result["train"]["runs"]
    assert set(runs) == {"hybrid_cpu", "hybrid_gpu", "inprocess_gpu", "peer_gpu"}
    for r in runs.values():
        has(r, "auc", "samples_per_s", "wall_s")
        assert 0 < r["auc"] < 1 and r["samples_per_s"] > 0
    assert len(result["targets_met"]) == 5


def test_a_failed_section_is_written_as_its_error_and_the_others_still_run():
    from loadtest.bench_gpu import kept, targets

    result: dict = {}
    kept(result, "lean", lambda: (_ for _ in ()).throw(RuntimeError("recserve exited -6: CUDA error")))
    kept(result, "dense", lambda: {"rows": [{"runtime": "torchscript", "batch": 2048, "p50_ms": 4.0},
                                            {"runtime": "cuda-graphs", "batch": 2048, "p50_ms": 0.5}]})  # fmt: skip
    assert result["lean"] == {"error": "recserve exited -6: CUDA error"}
    assert targets(result) == {"dense at 2,048 on the GPU <= 0.2x the CPU's time": True}
