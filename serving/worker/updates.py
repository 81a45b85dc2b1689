"""The worker's updates in flight: background jobs counted by sequence number, the staleness
waits, and the first failure, kept for the next call to raise.

A job runs on one of ``threads`` update threads, or (``ordered=True``) on the one exchange thread
that runs its jobs one at a time in the order queued (the trainer's update-with-lookup calls,
each reading after the last). ``wait(K)`` blocks while more than K jobs are in flight (the
staleness bound; ``wait(0)`` is a flush); ``wait_older(seq, K)`` only counts jobs queued before
``seq``. A job that raises is logged and kept: ``raise_error`` (called by ``wait`` and by the
worker's next call) re-raises it once, as ``UpdateError``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["UpdateError", "UpdateQueue"]

log = logging.getLogger("recserve.worker")


class UpdateError(RuntimeError):
    """A background update failed; raised by the next forward/push/flush (cause attached)."""

    @property
    def grpc_status(self) -> str:
        return getattr(self.__cause__, "grpc_status", None) or "INTERNAL"


class UpdateQueue:
    """Background update jobs of one worker, counted while in flight."""

    def __init__(self, threads: int):
        self._updates = ThreadPoolExecutor(threads, thread_name_prefix="worker-update")
        # ordered jobs (update_lookup calls), one at a time in the order queued
        self._exchange = ThreadPoolExecutor(1, thread_name_prefix="worker-exchange")
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)  # notified when an in-flight job finishes
        self._running: set[int] = set()  # sequence numbers of the jobs in flight
        self._next_seq = 0
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> int:
        """Jobs queued or running."""
        return len(self._running)

    def submit(self, job: Callable[[int], None], ordered: bool = False) -> None:
        """Run ``job(seq)`` on an update thread (``ordered``: the exchange thread), counted in
        flight. The sequence number and the queue position are taken together, so ordered jobs
        run in sequence order (one waits only on older ones: never on one queued behind it)."""
        with self._lock:  # the job cannot finish before it is counted: _finish needs this lock
            seq = self._next_seq
            (self._exchange if ordered else self._updates).submit(self._background, seq, job)
            self._next_seq += 1
            self._running.add(seq)

    def wait(self, limit: int) -> None:
        """Block while more than ``limit`` jobs are in flight, then raise a kept failure."""
        with self._done:
            self._done.wait_for(lambda: len(self._running) <= limit)
        self.raise_error()

    def wait_older(self, seq: int, limit: int) -> None:
        """Block while more than ``limit`` jobs queued before ``seq`` are in flight."""
        with self._done:
            self._done.wait_for(lambda: sum(s < seq for s in self._running) <= limit)

    def raise_error(self) -> None:
        """Re-raise the first failure of a job since the last call (once)."""
        if self._error is not None:
            with self._lock:
                err, self._error = self._error, None
            if err is not None:
                raise UpdateError(f"a background embedding update failed: {err}") from err

    def close(self) -> None:
        """Run the queued jobs, then stop the threads."""
        self._exchange.shutdown(wait=True)
        self._updates.shutdown(wait=True)
        if self._error is not None:
            log.error("closed with a failed background update: %s", self._error)

    def _background(self, seq: int, job: Callable[[int], None]) -> None:
        """One queued job on its thread; a failure is kept for the next call to raise."""
        try:
            job(seq)
        except BaseException as e:
            log.error("background embedding update failed: %s", e)
            with self._lock:
                self._error = self._error or e
        finally:
            with self._done:
                self._running.discard(seq)
                self._done.notify_all()
