"""Sharing a host's CPU between serving and the work beside it: loading at low CPU priority beside
a process that serves (or trains) at normal priority, and host-wide turns for the work every
serving process of a host does at the same moment (``host_slot``)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("recserve.priority")


@contextlib.contextmanager
def loading_priority(niceness: int = 10) -> Iterator[None]:
    """Load a model (imports, checksums, warm-up) at low CPU priority, then serve at normal priority
    (a trainer's standby: stand by low, train at normal priority).

    A new version loading beside the serving one must not take its CPU: on a small machine the
    load otherwise stalls live requests for seconds. ``recserve up`` starts TorchServe's Python
    workers niced already (their start-up imports come before the handler runs); this keeps the
    handler's own loading niced and then returns the process to niceness 0. That needs
    CAP_SYS_NICE; without it the process keeps the lower priority and says so.

    Only where nothing in the process is serving yet: a niced thread that shares the GIL with
    requests (``recserve serve``'s loader, a follower) inverts priorities on a busy host."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(os.getpriority(os.PRIO_PROCESS, 0), niceness))
    except OSError:
        pass
    try:
        yield
    finally:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        except OSError as e:
            log.warning(
                "serving at niceness %d: cannot return to 0 after loading (%s)",
                os.getpriority(os.PRIO_PROCESS, 0),
                e,
            )


@contextlib.contextmanager
def host_slot(
    kind: str, slots: int, lock_dir: str | None = None, wait_s: float | None = None
) -> Iterator[bool]:
    """Hold one of the host's ``slots`` slots of ``kind``: a ``flock`` on a file in the temp
    directory, shared by every process of this user; the kernel releases it when the process
    dies, so none is ever stale. Yields True once held; with ``wait_s``, False when none came free
    within that long (the work goes ahead without a turn, and says so) -- a holder that stalls
    (stopped, on a hung disk) then delays the others by ``wait_s``, never stops them."""
    base = Path(lock_dir or tempfile.gettempdir())
    name = f"recserve-{kind}-{os.getuid()}"
    fds = [os.open(base / f"{name}-{k}.lock", os.O_RDWR | os.O_CREAT, 0o600) for k in range(slots)]
    try:
        held = _take(fds) or _wait(fds, wait_s)
        if not held:
            log.warning("no %s slot came free in %gs: going ahead without one", kind, wait_s)
        yield held
    finally:
        for fd in fds:  # closing releases the lock
            os.close(fd)


def _take(fds: list[int]) -> bool:
    """A free slot, without waiting."""
    for fd in fds:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            continue
    return False


def _wait(fds: list[int], wait_s: float | None) -> bool:
    """A slot when one comes free: the process's own one for good (``wait_s`` None), else any, for
    at most ``wait_s`` seconds (polled every millisecond)."""
    if wait_s is None:
        fcntl.flock(fds[os.getpid() % len(fds)], fcntl.LOCK_EX)
        return True
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(0.001)
        if _take(fds):
            return True
    return False
