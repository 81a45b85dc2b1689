"""The README's five-minute tour, run as a user types it: each line as a subprocess, exactly as printed
(only ``<key_file>`` is filled in from what ``up`` printed), with the store in a temp dir via
``$RECSERVE_STORE``. Checks every exit code and the scores."""

import os
import re
import shlex
import subprocess

import pytest

import model_store
from tests.helpers import ROOT, doc_blocks, port_free, recserve_argv


def tour_lines() -> list[str]:
    (block,) = doc_blocks("README.md", "A five-minute tour")
    return block


@pytest.mark.slow
def test_quick_tour_runs_as_printed(tmp_path, readme_ports):
    if not all(port_free(p) for p in (8080, 8081, 8082)):
        pytest.skip("the tour's default ports 8080-8082 are taken on this machine")
    env = {**os.environ, "RECSERVE_STORE": str(tmp_path / "store")}
    lines = tour_lines()
    assert [shlex.split(x)[1] for x in lines] == ["train", "up", "score", "versions", "down"]
    outputs = {}
    try:
        for line in lines:
            key_file = re.search(r"from (\S+key_file\S*\.json)", outputs.get("up", ""))
            if "<key_file>" in line:
                assert key_file, outputs.get("up")
                line = line.replace("<key_file>", key_file.group(1))
            run = subprocess.run(
                recserve_argv(line), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
            )
            outputs[shlex.split(line)[1]] = run.stdout
            logs = "".join(p.read_text(errors="replace")[-3000:] for p in tmp_path.rglob("model_log.log"))
            assert run.returncode == 0, f"{line}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}\n{logs}"
    finally:
        subprocess.run(
            recserve_argv("recserve down --model criteo"), cwd=ROOT, env=env, capture_output=True, timeout=120
        )
    assert (tmp_path / "store" / "criteo" / "CURRENT").read_text().strip() == "1"
    assert '"auc"' in outputs["train"]
    scored = re.findall(r"request \d+: (\d+) scores \[([0-9., ]+)", outputs["score"])
    assert [int(n) for n, _ in scored] == [200, 200]
    heads = [float(x) for _, head in scored for x in re.findall(r"\d+\.\d+", head)]
    assert len(heads) >= 2 and all(0.0 < x < 1.0 for x in heads), outputs["score"]
    assert '"embedding": "1"' in outputs["score"] and '"dense": "1"' in outputs["score"]
    assert re.search(r"^\*\s+1\s+ok", outputs["versions"], re.M)
    assert (
        "lookups      shard 0 colocated, shard 1 colocated (TorchServe's handler)" in outputs["versions"]
    ), outputs["versions"]  # `up` picks co-located lookups: the version's files are on this host
    runtime = model_store.read_manifest(tmp_path / "store" / "criteo" / "1").dense_runtime.default  # type: ignore[union-attr]
    assert (
        f"dense model  version 1 (TorchServe's default), runtime {runtime} on cpu" in outputs["versions"]
    ), outputs["versions"]  # the handler serves the runtime the export measured faster, and says so
    assert "stopped" in outputs["down"]
