"""``make demo``, run as a user types it (the README's first command), over a model store in a
temp dir (``$RECSERVE_STORE``): it must exit 0 and report every step."""

import os
import shutil
import subprocess

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("make") is None or shutil.which("java") is None, reason="needs make and Java"
)
def test_make_demo_runs_every_step(tmp_path):
    env = {**os.environ, "RECSERVE_STORE": str(tmp_path / "store")}
    run = subprocess.run(["make", "demo"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-4000:]
    for n in ("1.", "2-3.", "4.", "5.", "6.", "7."):
        assert f"== {n}" in out, f"step {n} missing:\n{out[-4000:]}"
    assert (tmp_path / "store" / "criteo" / "CURRENT").is_file(), (
        "the demo published no version into the store"
    )
