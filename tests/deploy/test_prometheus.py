"""deploy/prometheus: promtool accepts the scrape config and the alert rules (the live evaluation of
every rule and dashboard query is tests/serving/stack/test_local.py)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from tests.helpers import ROOT

PROM = ROOT / "deploy" / "prometheus"


@pytest.fixture
def promtool():
    found = shutil.which("promtool")
    if found is None:  # `make test` installs Debian's prometheus package, which has it
        pytest.fail("no promtool: `apt-get install prometheus` (make test does)")
    return found


@pytest.mark.parametrize("what,path", [("rules", PROM / "alerts.yml"), ("config", PROM / "prometheus.yml")])
def test_promtool_accepts(promtool, what, path):
    out = subprocess.run([promtool, "check", what, str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    if what == "rules":  # every rule of the file, none dropped
        import yaml

        rules = sum(len(g["rules"]) for g in yaml.safe_load(path.read_text())["groups"])
        assert rules >= 6 and f"SUCCESS: {rules} rules found" in out.stdout + out.stderr
