"""Sharing a host's CPU between serving and the work beside it: loading at low CPU priority beside
a process that serves (or trains) at normal priority, host-wide turns for the work every
serving process of a host does at the same moment (``host_slot``), and a finer GIL hand-over
where requests share their interpreter with the work that applies deltas
(``share_gil_with_followers``)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("recserve.priority")

FOLLOW_SWITCH_S = 0.0005
"""The GIL switch interval of a TorchServe worker whose requests share the interpreter with delta
followers (CPython's default: 5 ms)."""


def share_gil_with_followers() -> None:
    """Hand the GIL over every ``FOLLOW_SWITCH_S`` (at most) in a TorchServe worker whose requests
    share it with threads that apply deltas (co-located shards). A request thread that gives the
    GIL up (in numpy or torch) waits up to the switch interval to get it back from a follower in
    the middle of a merge, each time. Measured with bench-swap's TorchServe worker and its two
    co-located shards (``python -m loadtest.bench_swap --lookups colocated --rounds 1``, five
    interleaved pairs, 5 ms against 0.5 ms): the deltas' windows' p99 over steady 2.35, 1.72,
    1.41, 1.03, 1.63 against 1.27, 1.64, 1.07, 1.00, 1.18, lower in each pair; the first delta's
    p99 a median of 17.0 ms against 9.3.

    Not in ``recserve serve``: its event loop, scoring thread and impression log are more threads
    to switch among, and in a 30-minute soak (``python -m loadtest.bench_soak``, deltas every
    0.5 s) its p99 per 5-minute window was 9.0-23.3 ms with 0.5 ms against 12.0-15.9 with 5 ms,
    and its CPU 9.7-12.5% against 9.3-10.5% (one run each)."""
    sys.setswitchinterval(min(sys.getswitchinterval(), FOLLOW_SWITCH_S))


LOAD_SLOTS = max(1, (os.cpu_count() or 1) // 4)
"""Scoring processes of a host that may load a new version at once (the workers of ``recserve serve
--workers N`` all learn of a new CURRENT at the same moment); the others serve meanwhile."""
LOAD_WAIT_S = 30.0
"""How long a load waits for a turn before it goes ahead without one (and says so)."""


@contextlib.contextmanager
def loading_beside_requests(kind: str = "load", lock_dir: str | None = None) -> Iterator[None]:
    """Load a new version in a process that serves requests meanwhile: in one of the host's
    ``LOAD_SLOTS`` turns of ``kind``, and with the GIL handed over every ``FOLLOW_SWITCH_S`` while
    it loads (the interval before is restored after). One kind per role: a scorer's load waits for
    the PS shards to serve the version (remote lookups), so they must not wait for its turn.

    A request thread that gives the GIL up (in numpy or torch) waits up to the switch interval to
    get it back from the loader, each time, and a load holds it for milliseconds at a stretch
    (TorchScript's load: 5-7 ms): 200-item requests beside a scorer being built in the same
    process took 24-33 ms at 5 ms against 13-15 ms at 0.5 ms (1-5 ms with no load). Only for the
    load: kept on, 0.5 ms cost ``recserve serve`` more than it gained (``share_gil_with_followers``)."""
    with host_slot(kind, LOAD_SLOTS, lock_dir, wait_s=LOAD_WAIT_S):
        before = sys.getswitchinterval()
        sys.setswitchinterval(min(before, FOLLOW_SWITCH_S))
        try:
            yield
        finally:
            sys.setswitchinterval(before)


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
