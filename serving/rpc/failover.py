"""Calls spread over equivalent servers that fail over between them: the one routing both a PS
shard's replicas (``serving.worker.replicas.ReplicaSet``) and a frontend's embedding workers
(``serving.worker.client.WorkerSet``) use.

Round robin over the servers whose gRPC health says SERVING (a daemon thread checks each every
``health_poll_s``; ``admit`` may refuse one that turns SERVING, e.g. the wrong shard). A call that
fails because of the server's state -- unreachable, too slow, or serving no (or not the pinned)
version -- goes to the next server while the call's deadline allows; each attempt gets an equal
share of the time left among the servers not yet tried, so one whose host stopped answering (its
link down: packets dropped, no reset) costs a share of the deadline, never all of it. A server
that could not be reached or timed out leaves the rotation at once, and comes back when its health
says SERVING again (a health check gets at most ``health_timeout_s``). When none is known to be
SERVING, a call still tries each in turn: the error then names every server and why. Other failures
(a bad request) are raised as they are: every server would answer the same.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

log = logging.getLogger("recserve.failover")

C = TypeVar("C")
R = TypeVar("R")

__all__ = ["Attempt", "Failover", "is_host_port"]


class Attempt:
    """How one failed call counts: ``retry`` (the server's state, try another), ``down`` (also
    take it out of the rotation: unreachable or too slow) and the status to show for it."""

    __slots__ = ("down", "retry", "status")

    def __init__(self, retry: bool, down: bool = False, status: str = "UNAVAILABLE"):
        self.retry, self.down, self.status = retry, down, status


class Failover(Generic[C]):
    """``clients`` (each with ``target`` and ``health()``), routed as the module doc says. ``name``
    is what logs and errors call the group (e.g. "PS shard 0")."""

    def __init__(self, clients: Sequence[C], name: str, health_poll_s: float = 0.5):
        if not clients:
            raise ValueError(f"{name}: no servers given")
        self.replicas: list[C] = list(clients)
        self.name = name
        self.target = "|".join(self._target(c) for c in self.replicas)
        self._status = ["UNKNOWN"] * len(self.replicas)  # health as last seen (or a failed call)
        self._lock = threading.Lock()
        self._turn = itertools.count()
        self.failovers = 0
        """Calls answered by another server after one failed."""
        self._stop = threading.Event()
        self._poll_s = health_poll_s
        self._thread: threading.Thread | None = None

    @staticmethod
    def _target(client: object) -> str:
        return str(getattr(client, "target", None) or getattr(client, "address", "?"))

    # ---- routing -------------------------------------------------------------------------------
    def serving(self) -> list[int]:
        """Indexes of the servers that get traffic now."""
        with self._lock:
            return [i for i, s in enumerate(self._status) if s == "SERVING"]

    def order(self) -> list[int]:
        """Servers to try, in order: the SERVING ones round robin (or every one, when none is)."""
        up = self.serving() or list(range(len(self.replicas)))
        k = next(self._turn) % len(up)
        return up[k:] + up[:k]

    def call(
        self,
        fn: Callable[[C, float], R],
        timeout_s: float,
        classify: Callable[[BaseException], Attempt | None],
    ) -> tuple[R, list[BaseException]]:
        """``fn(client, seconds)`` on the servers in ``order()`` until one answers, within
        ``timeout_s`` in all; ``classify`` says how a failure counts (None: raise it as is).
        Returns (the answer, the failures before it); when none answered, raises ``FailedOver``
        carrying every failure."""
        deadline = time.monotonic() + timeout_s
        order = self.order()
        errors: list[BaseException] = []
        for n, i in enumerate(order):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                answer = fn(self.replicas[i], left / (len(order) - n))
            except Exception as e:
                how = classify(e)
                if how is None or not how.retry:
                    raise
                errors.append(e)
                if how.down:
                    self.set_status(i, how.status)
                continue
            if errors:
                self.failovers += 1
                log.info("%s: answered by %s after %s", self.name, self._target(self.replicas[i]), errors[-1])
            return answer, errors
        why = "; ".join(str(e) for e in errors) or "none was tried"
        if time.monotonic() >= deadline and len(errors) < len(self.replicas):
            why += f" (deadline reached after {len(errors)} of {len(self.replicas)})"
        raise FailedOver(f"{self.name} ({self.target}): none answered: {why}", errors)

    # ---- health --------------------------------------------------------------------------------
    def health(self) -> str:
        """SERVING while some server is; else NOT_SERVING."""
        return "SERVING" if self.serving() else "NOT_SERVING"

    def describe(self) -> str:
        with self._lock:
            return ", ".join(
                f"{self._target(c)} {s}" for c, s in zip(self.replicas, self._status, strict=True)
            )

    def statuses(self) -> list[str]:
        with self._lock:
            return list(self._status)

    def set_status(self, i: int, status: str) -> None:
        if self._stop.is_set():  # closing: its channels are closed, its checks say nothing
            return
        with self._lock:
            old, self._status[i] = self._status[i], status
        if old != status:
            self.status_changed(i, old, status)

    def status_changed(self, i: int, old: str, new: str) -> None:
        """Logged: leaving SERVING is the news; coming (back) to it is routine."""
        level = logging.WARNING if old == "SERVING" else logging.INFO
        log.log(level, "%s: %s %s -> %s", self.name, self._target(self.replicas[i]), old, new)

    def admit(self, i: int, client: C, status: str) -> str:
        """The status to record for server ``i`` whose health said ``status`` (a subclass may
        check more before it gets traffic)."""
        return status

    def check(self) -> None:
        """One health pass over the servers (the poller's; also callable directly)."""
        for i, client in enumerate(self.replicas):
            self.set_status(i, self.admit(i, client, client.health()))  # type: ignore[attr-defined]

    def start_polling(self) -> None:
        self._thread = threading.Thread(target=self._poll, name=f"failover-{self.name}", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.check()
            except Exception:  # keep polling: the next pass may succeed
                log.exception("%s: health check failed", self.name)

    def close(self) -> None:
        self._stop.set()
        for c in self.replicas:
            c.close()  # type: ignore[attr-defined]


class FailedOver(Exception):
    """No server answered; ``errors`` holds each failure, in the order tried."""

    def __init__(self, message: str, errors: list[BaseException]):
        super().__init__(message)
        self.errors = errors


def is_host_port(address: str) -> bool:
    """``address`` is HOST:PORT with a port in 1..65535 (the form every server list here takes)."""
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536
