"""The README's "Data at scale" commands, run as a user types them: each line a subprocess,
exactly as printed (the model store in a temp dir via ``$RECSERVE_STORE``)."""

import json
import os
import re
import shlex
import shutil
import subprocess

import pytest

from tests.helpers import ROOT, recserve_argv


def scale_lines() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Data at scale\n.*?```bash\n(.*?)```", text, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


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
