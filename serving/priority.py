"""Loading at low CPU priority beside a process that serves (or trains) at normal priority."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

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
