"""serving/memory.py: what a serving process loaded for good leaves the collector's scans once; what a
process freed goes back to the system."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from serving.memory import _libc as memory_libc
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


TRIMMING = """
from serving import memory
from serving.memory import rss_mb  # what grows and falls here is anonymous memory
from tests.helpers import wait_until

base = rss_mb()
blocks = [bytearray(4000) for _ in range(50_000)]  # ~200 MB of glibc's heap (under its mmap threshold)
kept = blocks[::100] + [blocks[-1]]  # a block alive every 400 KB and at the top: no automatic trim
del blocks
freed = rss_mb()
assert freed > base + 150, (base, freed)  # freed, and kept by the allocator
with memory.trimming(0.1):
    wait_until(lambda: rss_mb() <= base + 50, 10, "the freed pages back")
print(f"{freed:.0f} {rss_mb():.0f}")
"""


def test_trimming_returns_what_a_process_freed_to_the_system():
    if not Path("/proc/self/status").exists() or memory_libc() is None:
        pytest.skip("needs glibc and /proc")
    out = subprocess.run(
        [sys.executable, "-c", TRIMMING], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    freed, after = map(float, out.stdout.split())
    assert after < freed - 100, (freed, after)  # the freed pages went back within the deadline
