"""Giving freed memory back to the system after a version is dropped.

A process that loads a new version beside the served one (the streaming trainer at a full version,
the scoring core at a dense switch) frees the old one's arrays afterwards, but glibc's allocator
keeps freed heap pages, and it raises its mmap threshold after the first large free, so later
arrays under 32 MB come from the heap too. ``trim()`` asks glibc to return free pages
(``malloc_trim``) after a switch (the streaming trainer, the controller, a PS shard that read a
version's deltas for its flip); on another C library it
does nothing. ``trimming()`` trims every ``TRIM_EVERY_S`` on a thread of its own, for a process
whose frees come from its steady work, not from a switch (the joiner, the streaming trainer and
its standby). ``freeze_loaded()`` takes what a serving process holds for its life out of the cyclic
collector's scans, once its first version is loaded."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import logging
import os
import threading
import time
from collections.abc import Iterator

log = logging.getLogger("recserve.memory")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


def trim(collect: bool = True) -> bool:
    """Return the allocator's free pages to the system; whether any were (False without glibc).

    ``collect`` runs a full garbage collection first, for cycles that hold what was dropped. A
    process that serves requests passes False: a version's arrays have no cycles and go with their
    last reference, and a full collection holds the GIL for 7 ms in a PS shard and 45-60 ms in a
    process that imported torch (a scoring frontend), stalling every request meanwhile."""
    if collect:
        gc.collect()
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None else False


TRIM_EVERY_S = 30.0
"""How often ``trimming()`` returns free heap pages. In a 12-minute soak (bench-soak, 200 items a
request, a full version every 90 s), one ``malloc_trim`` took a restarted joiner from 338 to 257 MB
of anonymous memory (the catch-up's buffers, freed and kept), the trainer's standby from 369 to
336 MB (its version steps) and the trainer from 611 to 495 MB (its steps' freed temporaries)."""


@contextlib.contextmanager
def trimming(every_s: float = TRIM_EVERY_S) -> Iterator[threading.Event]:
    """``trim(collect=False)`` every ``every_s`` on a daemon thread while the block runs (the event
    it yields stops it early). ``malloc_trim`` runs with the GIL released, so Python threads go
    on; an allocation in an arena it is trimming waits for it (a few ms). Not for a serving process:
    there it would stall the requests that allocate meanwhile (they trim after a switch)."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(every_s):
            if not log.isEnabledFor(logging.DEBUG):
                trim(collect=False)
                continue
            t0, before = time.monotonic(), rss_mb()
            trim(collect=False)
            log.debug("trimmed the heap in %.1f ms: RSS %.0f -> %.0f MB", 1e3 * (time.monotonic() - t0), before,
                      rss_mb())  # fmt: skip

    thread = threading.Thread(target=run, name="recserve-trim", daemon=True)
    if _libc() is not None:
        thread.start()
    try:
        yield stop
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(5.0)


def rss_mb() -> float:
    """This process's resident set size in MB (NaN where /proc cannot say)."""
    from serving.rpc.procs import proc_stat

    stat = proc_stat(os.getpid())
    return stat.rss_bytes / 2**20 if stat is not None else float("nan")


@functools.cache
def freeze_loaded() -> int:
    """Take every object alive now out of the cyclic collector's generations (``gc.freeze``), once
    per process (later calls do nothing), after its first version is loaded (a scoring frontend, the
    streaming trainer and its standby) or its setup is done (the joiner): the imports (torch,
    numpy, grpc) and that version's objects live as long as the process, and a full (gen2)
    collection that scans them held the GIL for 80-155 ms in a scoring frontend that imported
    torch: at 200 requests/s every request behind it waited, and the p99 of a 15-second window
    rose from about 20 to 100-230 ms whenever one fell in it (bench-e2e, remote lookups). The
    streaming trainer's took 117-305 ms (270,000 objects) every 20-50 s at 10,000 samples/s, and a
    restarted joiner's 135-143 ms in its catch-up (bench-stream, ``gc.callbacks``). Later
    collections scan only what came since. The cost: cycles among the objects alive now (the first
    version's, once a later one replaces it) are never collected, once per process. Returns how
    many objects were frozen."""
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%d objects loaded for good: out of the garbage collector's scans", frozen)
    return frozen
