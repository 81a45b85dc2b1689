"""docs/training.md's "Data at scale" commands, run as a user types them: each line a subprocess,
exactly as printed (the model store in a temp dir via ``$RECSERVE_STORE``)."""

import json
import os
import shlex
import shutil
import subprocess

import pytest

from tests.helpers import ROOT, doc_blocks, recserve_argv, split_comment


def scale_lines() -> list[str]:
    (block,) = doc_blocks("docs/training.md", "Data at scale")
    return [split_comment(line)[0] for line in block]


@pytest.mark.slow
def test_data_at_scale_runs_as_printed(tmp_path):
    lines = scale_lines()
    assert [shlex.split(x)[1] for x in lines] == ["synth", "synth", "train", "train"]
    env = {**os.environ, "RECSERVE_STORE": str(tmp_path / "store")}
    try:
        summaries = []
        for line in lines:
            run = subprocess.run(
                recserve_argv(line), cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
            )
            assert run.returncode == 0, f"{line}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
            if shlex.split(line)[1] == "train":
                summaries.append(json.loads(run.stdout.strip().splitlines()[-1]))
        for summary in summaries:  # every distinct ID kept: nothing evicted, nothing expired
            assert summary["ps_rows"] > 100_000 and summary["evictions"] == 0 and summary["expired"] == 0
            assert summary["auc"] > 0.6
    finally:
        shutil.rmtree("/tmp/recserve", ignore_errors=True)
