"""An experiment's shadow arms, scored off the response path (``serving.scoring.arms.Router``).

A request served while an experiment with shadow arms runs is offered here after its own arm took
it (``offer``: a bounded queue append, constant time, never blocking). One background thread takes
each offered request and runs it through the request loop once per shadow arm, with that arm's
scorer (decode, lookup, predict: the version it serves, never mixed), stamped with the arm; its
scores go to the impression log beside the served request's, as an impression of request id
``<request id>#shadow-<arm>`` with that arm on the topic ``<impression topic>.shadow``
(``serving.scoring.impressions``: the joiner, which reads the impression topic, never takes it for
a request of its own). Its reply goes to ``on_reply`` (the per-arm request counter) and nowhere
else. When the queue is full the request is dropped for every shadow arm and counted
(``dropped``; ``recserve_scoring_shadow_dropped_total{arm}`` on the frontends' /metrics).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from serving.scoring.core import Scorer
from serving.scoring.errors import Reply
from serving.scoring.loop import Outcome, complete, prepare, reply_of, stamped

if TYPE_CHECKING:
    from serving.scoring.impressions import ImpressionLog

log = logging.getLogger("recserve.scoring")

SUFFIX = "#shadow-"
"""A shadow arm's impression is keyed ``<request id>#shadow-<arm>``."""


def shadow_id(rid: str, arm: str) -> str:
    return f"{rid}{SUFFIX}{arm}"


class ShadowArm(NamedTuple):
    """A shadow arm as served: its name, its version's scorer, what its versions gain."""

    name: str
    scorer: Scorer
    stamp: dict[str, Any]


class Shadows:
    """A bounded queue of requests for the shadow arms, drained by one thread (started at the
    first offer: a process that never serves a shadow has none)."""

    def __init__(self, log: ImpressionLog | None, capacity: int = 64):
        self.log, self.capacity = log, capacity
        self.dropped: dict[str, int] = {}
        """Per shadow arm: requests not scored (the queue was full)."""
        self.on_reply: Callable[[Reply], None] = lambda reply: None
        """Told of each shadow scoring's reply (its versions name the arm)."""
        self._queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # the thread's start and the counters
        self._thread: threading.Thread | None = None

    def offer(self, arms: Sequence[ShadowArm], body: bytes, content_type: str | None, rid: str) -> None:
        """Queue a served request for the shadow ``arms``, or drop and count it when full."""
        if self._queue.qsize() >= self.capacity:
            with self._lock:
                for arm in arms:
                    self.dropped[arm.name] = self.dropped.get(arm.name, 0) + 1
            return
        if self._thread is None:
            self._start()
        self._queue.put((arms, body, content_type, rid))

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name="recserve-shadow", daemon=True)
                self._thread.start()

    def _drain(self) -> None:
        while (item := self._queue.get()) is not None:
            arms, body, content_type, rid = item
            for arm in arms:
                try:
                    self.on_reply(reply_of(self.score(arm, body, content_type, rid)))
                except Exception:  # one request's failure must not stop the thread
                    log.exception("shadow arm %s: scoring failed", arm.name)

    def score(self, arm: ShadowArm, body: bytes, content_type: str | None, rid: str) -> Outcome:
        """``arm`` scores the request alone, logging it as ``shadow_id(rid, arm.name)``."""
        started = stamped(
            prepare(arm.scorer, body, content_type, shadow_id(rid, arm.name), self.log), arm.stamp
        )
        return started if isinstance(started, Outcome) else complete([started])[0]

    def collect(self) -> list[Any]:
        """The drops as a Prometheus counter (registered on the lean frontend's registry)."""
        from prometheus_client.core import CounterMetricFamily

        from serving.scoring.names import SHADOW_DROPPED

        family = CounterMetricFamily(SHADOW_DROPPED[: -len("_total")],
                                     "Requests a shadow arm did not score (its queue was full)", labels=["arm"])  # fmt: skip
        with self._lock:
            for arm, n in sorted(self.dropped.items()):
                family.add_metric([arm], n)
        return [family]

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread once it has scored what is queued (within ``timeout_s``)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout_s)
