"""serving/scoring/preload.py, in a process of its own (it imports torch and freezes the collector):
it loads the decode kernels of the version CURRENT names, or none when nothing is published, and
refuses a parent that runs a thread (a fork would copy it stopped, with whatever lock it held)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.slow

SCRIPT = """
import sys, threading
from serving.scoring.lean import ServeConfig
from serving.scoring.preload import preload

if sys.argv[2] == "thread":
    stop = threading.Event()
    threading.Thread(target=stop.wait, name="holder", daemon=True).start()
print(preload(ServeConfig(store=sys.argv[1], workers="2", disable_token_auth=True)))
import features.jsonscan
print("scan loaded:", bool(features.jsonscan._scan.signatures))
"""


def preload(store, mode: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", SCRIPT, str(store), mode], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_the_parent_loads_the_decode_kernels_of_the_served_version(trained):
    done = preload(trained[0])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "the decode kernels of version 1's schema" in done.stdout and "scan loaded: True" in done.stdout


def test_without_a_published_version_only_the_modules_load(tmp_path):
    done = preload(tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no decode kernels (nothing published yet)" in done.stdout and "scan loaded: False" in done.stdout


def test_a_parent_that_runs_a_thread_is_refused(tmp_path):
    done = preload(tmp_path, "thread")
    assert done.returncode != 0
    assert "RuntimeError: the frontend's parent runs threads ['holder']" in done.stderr
