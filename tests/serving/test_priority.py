"""Sharing a host's CPU: host-wide slots (the checksum slot's own test is in ps/test_mapped.py)."""

from __future__ import annotations

import logging
import threading

from serving.priority import host_slot


def test_a_slot_not_freed_in_wait_s_is_gone_without_and_said(tmp_path, caplog):
    """A holder that stalls delays the others by ``wait_s``, never stops them; each says so."""
    with host_slot("apply", 1, str(tmp_path)) as first:
        assert first
        with caplog.at_level(logging.WARNING, logger="recserve.priority"):
            with host_slot("apply", 1, str(tmp_path), wait_s=0.05) as second:
                assert not second
        assert "no apply slot came free in 0.05s" in caplog.text
        with host_slot("checksum", 1, str(tmp_path), wait_s=0.05) as other_kind:
            assert other_kind  # kinds do not share slots


def test_a_waiter_gets_the_slot_when_it_is_freed(tmp_path):
    got = threading.Event()
    release = threading.Event()

    def holder():
        with host_slot("apply", 1, str(tmp_path)):
            got.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    assert got.wait(10)
    release.set()
    with host_slot("apply", 1, str(tmp_path), wait_s=10) as held:
        assert held
    t.join(10)


def test_a_load_beside_requests_takes_a_turn_and_hands_the_gil_over_finely_until_it_is_done(
    tmp_path, monkeypatch
):
    import sys

    from serving import priority

    monkeypatch.setattr(priority, "LOAD_SLOTS", 1)  # one load at a time on this host
    before = sys.getswitchinterval()
    with priority.loading_beside_requests(lock_dir=str(tmp_path)):
        assert sys.getswitchinterval() == priority.FOLLOW_SWITCH_S
        with host_slot("load", 1, str(tmp_path), wait_s=0.05) as other_worker:
            assert not other_worker  # another worker's load waits for this one's turn
    assert sys.getswitchinterval() == before
    with host_slot("load", 1, str(tmp_path), wait_s=0.05) as next_worker:
        assert next_worker  # and gets it once this load is done
