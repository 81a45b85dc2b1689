"""One streaming trainer writes a model's deltas; a second one started beside it stands by, warm.

The trainer following a model holds ``<model>/.follow.lock`` (``flock``: the kernel lets go when
the process dies, SIGKILL included). A second trainer of the same model finds it held and stands
by: it loads the served version as any trainer does, and until the lock is free it applies each
delta the holder publishes (and moves to a new CURRENT), reading no samples and writing nothing.
It stands by at nice 10 (``serving.priority``), so its loads yield the CPU to serving and to the
trainer, and it waits for the lock in ``flock`` on a thread of its own: the kernel hands it the
lock as the holder dies, ahead of the holder's restart (which stands by in its place). It then
applies what is left, resumes where the last delta says (offsets and keys trained,
``StreamBook.resume``; a file source's ledger is read again) and trains on. Its successor's wait is
a few deltas' reads, where a restarted process waits for its imports, the version's load and every
delta since the version (in the 6-minute soak on 2 vCPUs, 6 s with 204 deltas; a full version
every 10 minutes at a delta every 0.5 s is up to 1,200).

The lock needs a file system whose ``flock`` is shared by the trainers: one host's, or a network
file system that supports it (NFSv4, CephFS); ranks under torchrun do not take it.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from serving.priority import loading_priority

if TYPE_CHECKING:
    from training.follow.book import StreamBook
    from training.follow.config import FollowConfig
    from training.follow.types import Loaded

log = logging.getLogger("recserve.train.follow")

LOCK = ".follow.lock"
POLL_S = 0.1
"""How often a standby looks for the lock and for new deltas."""


class Standing(Protocol):
    """What ``stand_by`` needs of a trainer (``training.follow.trainer.FollowTrainer``): its config,
    book and loaded version, and the two verbs of a standby."""

    @property
    def cfg(self) -> FollowConfig: ...
    @property
    def book(self) -> StreamBook: ...
    @property
    def loaded(self) -> Loaded | None: ...

    def keep_up(self) -> int: ...
    def take_over(self) -> None: ...


class FollowLock:
    """``<model>/.follow.lock``, held by the trainer writing the model's deltas."""

    def __init__(self, model_dir: Path):
        self.path = model_dir / LOCK
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        self.held = False
        self.got = threading.Event()
        """Set once ``wait_for_it``'s thread holds the lock (``take`` then makes it this trainer's)."""
        self._waiter: threading.Thread | None = None
        self._dup = -1  # the waiter's descriptor, once it holds the lock
        self._mutex = threading.Lock()  # the waiter's taking against close()

    def take(self) -> bool:
        """Whether it is ours now (never blocks)."""
        if not self.held:
            if not self.got.is_set():
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False
            self.held = True
            os.ftruncate(self._fd, 0)
            os.write(self._fd, f"{os.getpid()}\n".encode())  # who holds it, for a person looking
        return True

    def wait_for_it(self) -> None:
        """Take the lock the moment its holder lets go, on a thread of its own that waits in the
        kernel (``take`` then says so). A standby's looks come every ``POLL_S`` between its delta
        applications, at nice 10: on a busy host a trainer restarted beside it took the lock first
        (its non-blocking try a few seconds after the kill, before any look of the standby's), and
        the warm standby stood by while the cold one loaded the version. A waiter in ``flock`` is
        woken by the kernel as the holder exits."""
        if self.held or self._waiter is not None:
            return
        fd = os.dup(self._fd)  # the waiter's own: the same open file, so the same lock

        def wait() -> None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)  # the GIL released while it waits
            except OSError:
                os.close(fd)
                return
            with self._mutex:
                if self._fd < 0:  # closed while it waited: let go
                    os.close(fd)
                    return
                self._dup = fd
                self.got.set()

        self._waiter = threading.Thread(target=wait, name="recserve-follow-lock", daemon=True)
        self._waiter.start()

    def holder(self) -> str:
        try:
            return self.path.read_text().strip() or "?"
        except OSError:
            return "?"

    def close(self) -> None:
        with self._mutex:
            for fd in (self._fd, self._dup):
                if fd >= 0:
                    os.close(fd)  # lets go of the lock with the last of them
            self._fd, self._dup, self.held = -1, -1, False


def stand_by(trainer: Standing, lock: FollowLock, stop: threading.Event) -> bool:
    """Keep ``trainer`` at the newest delta until ``lock`` is ours (True: train on) or ``stop``
    (False: nothing was trained or written)."""
    gauge = None
    if trainer.book.registry is not None:
        from prometheus_client import Gauge

        gauge = Gauge("recserve_follow_standby", "1 while this trainer stands by (another writes the deltas).",
                      registry=trainer.book.registry)  # fmt: skip
        gauge.set(1)
    log.info("standing by: pid %s follows %s (it holds %s); applying its deltas until it exits",
             lock.holder(), trainer.cfg.follow, lock.path)  # fmt: skip
    applied = 0
    lock.wait_for_it()  # at normal priority: the lock is ours as its holder exits, looks or not
    with loading_priority():  # at nice 10 while standing by: its loads yield to serving and training
        trainer.keep_up()
        while not lock.take():
            if stop.wait(POLL_S):
                return False
            applied += trainer.keep_up()
    trainer.keep_up()
    trainer.take_over()
    if gauge is not None:
        gauge.set(0)
    lv = trainer.loaded
    assert lv is not None
    log.info("took over %s/%s at delta %d (%d deltas applied while standing by)", trainer.cfg.model, lv.version,
             lv.cluster.stores[0].delta_seq, applied)  # fmt: skip
    return True
