"""training/follow/standby.py: one writer of a model's deltas, and a warm standby that has the lock
the moment the writer dies, ahead of the writer's restart."""

from __future__ import annotations

import os
import threading
from types import SimpleNamespace

from tests.helpers import wait_until
from training.follow.standby import FollowLock, stand_by


class Busy:
    """A standby (``standby.Standing``) whose delta application lasts until ``go`` is set: a
    standby at nice 10 on a busy host, between two looks at the lock."""

    def __init__(self, follow: str):
        self.cfg = SimpleNamespace(follow=follow, model="m")
        self.book = SimpleNamespace(registry=None)
        self.loaded = SimpleNamespace(
            version="1", cluster=SimpleNamespace(stores=[SimpleNamespace(delta_seq=3)])
        )
        self.applying, self.go = threading.Event(), threading.Event()
        self.took_over = False

    def keep_up(self) -> int:
        self.applying.set()
        self.go.wait(60)
        return 1

    def take_over(self) -> None:
        self.took_over = True


def test_the_standby_has_the_lock_as_the_writer_dies_though_busy_and_its_restart_stands_by(tmp_path):
    writer = FollowLock(tmp_path)
    assert writer.take()
    standby, lock, stop, result = Busy(str(tmp_path)), FollowLock(tmp_path), threading.Event(), []
    thread = threading.Thread(target=lambda: result.append(stand_by(standby, lock, stop)), daemon=True)
    thread.start()
    try:
        wait_until(standby.applying.is_set, 30, "the standby applying a delta")
        assert not lock.got.is_set()
        writer.close()  # the writer dies: the kernel lets go of its lock
        wait_until(lock.got.is_set, 30, "the busy standby holding the lock")
        restarted = FollowLock(tmp_path)  # the writer's restart, trying as it starts
        assert not restarted.take()
        standby.go.set()
        thread.join(30)
        assert result == [True] and standby.took_over
        assert lock.held and lock.holder() == str(os.getpid())
        restarted.close()
    finally:
        standby.go.set()
        stop.set()
        lock.close()


def test_a_standby_that_stopped_lets_go_of_the_lock_its_waiter_gets_later(tmp_path):
    writer, standby = FollowLock(tmp_path), FollowLock(tmp_path)
    assert writer.take()
    standby.wait_for_it()
    standby.close()  # stopped while it waited (the process goes on)
    writer.close()
    restarted = FollowLock(tmp_path)
    try:
        wait_until(restarted.take, 30, "the lock free again once the closed standby's waiter got it")
        assert not standby.got.is_set()
    finally:
        restarted.close()
