"""Wake-ups: a follower's poll run at once by each notice it wants, the poll interval the
timeout (so a missed notice costs one poll interval, never more)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from serving.notices.hub import Notices
from serving.notices.record import Notice


class Wake:
    """A follower's wake-up: set by each notice ``wants`` accepts, waited on with the poll interval
    as the timeout (so a missed notice costs one poll interval, never more)."""

    def __init__(self, notices: Notices | None, wants: Callable[[Notice], bool] = lambda n: True):
        self.event = threading.Event()
        self.wants = wants
        self._unsubscribe = notices.subscribe(self._on) if notices is not None else None

    def _on(self, notice: Notice) -> None:
        if self.wants(notice):
            self.event.set()

    def wait(self, timeout: float) -> bool:
        """True when woken by a notice (or ``set``), False at the timeout."""
        woken = self.event.wait(timeout)
        self.event.clear()
        return woken

    def set(self) -> None:
        self.event.set()

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()


class AsyncWake:
    """``Wake`` for a follower on an event loop (created on that loop)."""

    def __init__(self, notices: Notices | None, wants: Callable[[Notice], bool] = lambda n: True):
        self.event = asyncio.Event()
        self.wants = wants
        self._loop = asyncio.get_running_loop()
        self._unsubscribe = notices.subscribe(self._on) if notices is not None else None

    def _on(self, notice: Notice) -> None:
        if self.wants(notice):
            self._loop.call_soon_threadsafe(self.event.set)

    async def wait(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self.event.wait(), timeout)
            return True
        except TimeoutError:
            return False
        finally:
            self.event.clear()

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
