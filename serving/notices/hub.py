"""A process's notices of one model: the listener's thread hands each notice to every subscriber
(a follower's wake-up). A record that is not a notice is logged and counted
(``recserve_notices_total{outcome="malformed"}``), never raised; one of another model is counted
as ``other_model``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from serving.notices.metrics import Listening
from serving.notices.record import Notice, NoticeError, decode
from serving.notices.registry import parse

log = logging.getLogger("recserve.notices")

NOTICES = "recserve_notices_total"
OUTCOMES = ("ok", "malformed", "other_model")


class Notices:
    """The notices of the model at ``model_dir`` that this process receives over ``spec``, handed to
    every subscriber on the listener's thread; counted in ``registry`` (its own when None)."""

    def __init__(self, spec: str, model_dir: str | Path, registry=None):
        from prometheus_client import CollectorRegistry, Counter

        self.spec, self.model_dir = spec, Path(model_dir)
        self.model = self.model_dir.name
        self.transport, where = parse(spec)
        self.registry = registry if registry is not None else CollectorRegistry()
        self.counter = Counter(NOTICES, "Update notices received, by outcome (ok, malformed, other_model)",
                               ["transport", "outcome"], registry=self.registry)  # fmt: skip
        for outcome in OUTCOMES:
            self.counter.labels(self.transport.name, outcome)
        self.last: tuple[Notice, float] | None = None
        """The last notice of this model and the seconds from its ``ts`` to its receipt here."""
        self._subs: list[Callable[[Notice], None]] = []
        self._lock = threading.Lock()
        self.listener = self.transport.listen(where, self.model_dir, self)
        self.registry.register(Listening(self))

    def count(self, outcome: str) -> float:
        """Notices received with ``outcome`` (``OUTCOMES``)."""
        value = self.registry.get_sample_value(
            NOTICES, {"transport": self.transport.name, "outcome": outcome}
        )
        return value or 0.0

    def subscribe(self, fn: Callable[[Notice], None]) -> Callable[[], None]:
        """Call ``fn(notice)`` (on the listener's thread: keep it short) for each notice of this
        model; returns the unsubscribe."""
        with self._lock:
            self._subs.append(fn)

        def unsubscribe() -> None:
            with self._lock:
                if fn in self._subs:
                    self._subs.remove(fn)

        return unsubscribe

    def received(self, data: bytes | None) -> None:
        """A transport's record: decoded and delivered, or counted and logged as malformed."""
        try:
            notice = decode(data)
        except NoticeError as e:
            self.counter.labels(self.transport.name, "malformed").inc()
            log.error("malformed notice on %s (%r...): %s", self.spec, (data or b"")[:80], e)
            return
        self.deliver(notice)

    def deliver(self, notice: Notice) -> None:
        if notice.model != self.model:
            self.counter.labels(self.transport.name, "other_model").inc()
            log.warning("notice of model %s on %s (this process follows %s): ignored", notice.model,
                        self.spec, self.model)  # fmt: skip
            return
        self.last = (notice, time.time() - notice.ts)
        with self._lock:
            subs = list(self._subs)
        for fn in subs:
            try:
                fn(notice)
            except Exception:  # one subscriber's bug must not starve the others
                log.exception("notice subscriber failed on %s", notice)
        self.counter.labels(self.transport.name, "ok").inc()

    def close(self) -> None:
        self.listener.close()


def open_notices(spec: str, model_dir: str | Path, registry=None) -> Notices | None:
    """``Notices`` over ``spec`` ('none': None, the poll alone). A transport that cannot start
    (no inotify here, ...) is logged and leaves the poll alone: serving must not depend on it."""
    if spec == "none":
        return None
    parse(spec)  # an unknown transport is the caller's mistake: raised
    try:
        return Notices(spec, model_dir, registry)
    except OSError as e:
        log.error("notices over %s cannot start (%s): following %s by polling only", spec, e, model_dir)
        return None
