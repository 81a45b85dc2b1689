"""ScorerFollower: how a scoring process loads the version CURRENT names beside its requests."""

from __future__ import annotations

import sys
from types import SimpleNamespace

from model_store.layout import set_current
from serving import priority
from serving.priority import host_slot
from serving.scoring import follow
from serving.scoring.config import ScoringConfig


def test_a_new_version_loads_in_the_hosts_turn_with_the_gil_handed_over_finely(tmp_path, monkeypatch):
    # the workers of one frontend learn of a new CURRENT at once: each loads in a turn of the host
    # (here one), the GIL handed over every 0.5 ms while it loads, as it was after
    lock_dir = tmp_path / "locks"
    lock_dir.mkdir()
    monkeypatch.setattr(priority, "LOAD_SLOTS", 1)
    monkeypatch.setattr(priority.tempfile, "gettempdir", lambda: str(lock_dir))
    monkeypatch.setattr(follow.ms, "validate", lambda *a, **k: None)
    seen = {}

    def scorer(config, notices=None):
        with host_slot("load", 1, str(lock_dir), wait_s=0.05) as another:
            seen.update(
                interval=sys.getswitchinterval(), another_load=another, version_dir=config.version_dir
            )
        return SimpleNamespace(dense_version="1", lookup_modes=[], manifest=None, close=lambda: None)

    monkeypatch.setattr(follow, "Scorer", scorer)
    store = tmp_path / "store"
    (store / "criteo" / "1").mkdir(parents=True)
    set_current(store, "criteo", "1")
    before = sys.getswitchinterval()
    follower = follow.ScorerFollower(str(store), "criteo", ScoringConfig(notices="none"))
    try:
        assert follower.step() == "1"
    finally:
        follower.close()
    assert seen == {"interval": priority.FOLLOW_SWITCH_S, "another_load": False,
                    "version_dir": str(store / "criteo" / "1")}  # fmt: skip
    assert sys.getswitchinterval() == before


def test_a_new_version_is_warmed_with_the_processs_recent_requests_in_its_turn(tmp_path, monkeypatch):
    # its own warm-up runs one-row requests: the recent ones give the dense runtime their shape
    monkeypatch.setattr(follow.ms, "validate", lambda *a, **k: None)
    built = SimpleNamespace(dense_version="1", lookup_modes=[], manifest=None, close=lambda: None)
    monkeypatch.setattr(follow, "Scorer", lambda config, notices=None: built)
    warmed = []
    monkeypatch.setattr(follow, "warm", lambda scorer, requests: warmed.append(
        (scorer, requests, sys.getswitchinterval())))  # fmt: skip
    store = tmp_path / "store"
    (store / "criteo" / "1").mkdir(parents=True)
    set_current(store, "criteo", "1")
    follower = follow.ScorerFollower(str(store), "criteo", ScoringConfig(notices="none"))
    recent = [(b'[{"a": 1}]', "application/json")]
    follower.arms.recent = lambda: recent  # the router's (serving.scoring.arms.Router)
    try:
        assert follower.step() == "1"
        assert follower.scorer is built
    finally:
        follower.close()
    assert warmed == [(built, recent, priority.FOLLOW_SWITCH_S)]  # in the load's turn
