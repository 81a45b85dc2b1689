"""serving/memory.py: what a serving process loaded for good leaves the collector's scans once."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT

FREEZE = """
import gc
from serving import memory

loaded = [[] for _ in range(10_000)]  # tracked containers, alive for good
frozen = memory.freeze_loaded()
assert frozen >= 10_000 and gc.get_freeze_count() == frozen, (frozen, gc.get_freeze_count())
later = [[] for _ in range(10)]
assert memory.freeze_loaded() == frozen and gc.get_freeze_count() == frozen  # once per process
assert sum(len(gc.get_objects(g)) for g in range(3)) < frozen  # a full collection scans what came since
print("ok")
"""


def test_freeze_loaded_takes_what_is_alive_out_of_the_scans_once_per_process():
    # a process of its own: a freeze lasts as long as the process
    out = subprocess.run([sys.executable, "-c", FREEZE], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_scoring_process_freezes_once_its_first_version_is_loaded(trained, monkeypatch):
    from serving import memory
    from serving.scoring import lean

    calls: list[int] = []
    monkeypatch.setattr(memory, "freeze_loaded", lambda: calls.append(1) or 0)
    frontend = lean.Frontend(lean.ServeConfig(store=str(trained[0]), disable_token_auth=True))
    try:
        assert frontend.step() is not None and calls == [1]
        assert frontend.step() is None and calls == [1]  # nothing new: nothing frozen again
    finally:
        frontend.close()
