r"""Update notices: serving learns of a new delta or version when it is written, not at its next poll.

Whoever writes a delta's ``_SUCCESS`` (``recserve train --follow``, ``serving.ps.deltas.DeltaWriter``)
or moves ``CURRENT`` (``recserve publish``/``rollback``) announces it; every serving process (PS
shards, co-located frontends) listens and runs its follower's poll at once. The notice only names
what to load; the store stays the source of truth (the follower reads, checks and applies the files
as it does on a poll), and the poll stays, slower, as the fallback for a notice that never came.

**Notice** (one JSON object, the one reader is ``decode``)::

    {"model": "criteo", "version": "3", "delta_seq": 7, "ts": 1767225600.25}

``delta_seq`` -1 names the version itself (``CURRENT`` moved to it), N >= 0 its delta N; ``ts`` is
when the marker was written (seconds since the epoch). No other keys.

A transport is one module of this package that calls ``register(Transport(...))``, named in a spec
as ``<name>[://<where>]`` like ``training.sources``: ``kafka://BROKERS/TOPIC`` (one topic per model;
each process reads every partition from its end with its own consumer, so every process sees every
notice) and ``inotify`` (the kernel's file events on the model directory: one host, no announcer
needed, the marker's rename is the notice). ``none`` listens to nothing (the poll alone).

A process holds one ``Notices`` per model directory: the listener's thread hands each notice to
every subscriber (a follower's wake-up). A record that is not a notice is logged and counted
(``recserve_notices_total{outcome="malformed"}``), never raised; one of another model is counted
as ``other_model``.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import pkgutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import orjson

log = logging.getLogger("recserve.notices")

NOTICES = "recserve_notices_total"
LISTENING = "recserve_notices_listening"
LAG = "recserve_notice_lag_seconds"
VERSION = -1
"""The delta_seq of a notice of a version itself (CURRENT moved to it): a full dump's seq."""
OUTCOMES = ("ok", "malformed", "other_model")


class NoticeError(ValueError):
    """A record that is not a notice; the message says what is wrong."""


@dataclass(frozen=True)
class Notice:
    model: str
    version: str
    delta_seq: int
    """-1: the version itself (CURRENT moved to it; the store's seq of a full dump); N >= 0: its
    delta N."""
    ts: float
    """When the marker was written (seconds since the epoch)."""


def encode(notice: Notice) -> bytes:
    return orjson.dumps({"model": notice.model, "version": notice.version, "delta_seq": notice.delta_seq,
                         "ts": notice.ts})  # fmt: skip


def decode(data: bytes | None) -> Notice:
    """The notice in ``data``; a ``NoticeError`` naming the problem otherwise."""
    try:
        d = orjson.loads(data or b"")
    except orjson.JSONDecodeError as e:
        raise NoticeError(f"not JSON: {e}") from None
    keys = {"model", "version", "delta_seq", "ts"}
    if not isinstance(d, dict) or set(d) != keys:
        got = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise NoticeError(f"expected an object with keys {sorted(keys)}, got {got}")
    model, version, seq, ts = d["model"], d["version"], d["delta_seq"], d["ts"]
    if not isinstance(model, str) or not model or not isinstance(version, str) or not version.isdigit():
        raise NoticeError(f"bad model {model!r} or version {version!r} (a version is a number, as a string)")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < VERSION:
        raise NoticeError(f"delta_seq must be an integer >= -1, got {seq!r}")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts):
        raise NoticeError(f"ts must be a finite number, got {ts!r}")
    return Notice(model, version, seq, float(ts))


# ---- transports ------------------------------------------------------------------------------------
class Listener(Protocol):
    @property
    def listening(self) -> bool:
        """Whether notices sent now are received (a Kafka listener: once its partitions are assigned)."""
        ...

    def close(self) -> None: ...


class Announcer(Protocol):
    def announce(self, notice: Notice) -> None:
        """Send ``notice`` without waiting on its transport; one not delivered is logged and counted
        (the poll catches it up)."""
        ...

    def close(self) -> None:
        """Deliver what is in flight (a bounded wait)."""
        ...


@dataclass(frozen=True)
class Transport:
    name: str
    listen: Callable[[str, Path, Notices], Listener]
    """``listen(where, model_dir, notices)``: a running listener that calls ``notices.received``
    with each record (bytes) or ``notices.deliver`` with each notice it makes itself."""
    announcer: Callable[[str], Announcer] | None = None
    """``announcer(where)``; None: the transport needs none (the file write is the notice)."""
    check: Callable[[str], object] = lambda where: None
    """Raise a ValueError naming the form when ``where`` is not one (at start, before listening)."""


TRANSPORTS: dict[str, Transport] = {}


def register(transport: Transport) -> Transport:
    if transport.name in TRANSPORTS:
        raise ValueError(f"notice transport {transport.name!r} registered twice")
    TRANSPORTS[transport.name] = transport
    return transport


def parse(spec: str) -> tuple[Transport, str]:
    """(transport, where) of ``<name>[://<where>]``; a ValueError naming the known ones otherwise."""
    name, _, where = spec.partition("://")
    try:
        transport = TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown notice transport {spec!r}; known: {', '.join(TRANSPORTS)}") from None
    transport.check(where)
    return transport, where


def announcer(spec: str) -> Announcer | None:
    """The announcer of ``spec`` ('' or a transport that needs none: None)."""
    if not spec:
        return None
    transport, where = parse(spec)
    return transport.announcer(where) if transport.announcer is not None else None


def announce(announcer: Announcer | None, model_dir: str | Path, version: str, seq: int, ts: float) -> None:
    """Announce delta ``seq`` (``VERSION``: the version) of ``version`` of the model at ``model_dir``."""
    if announcer is not None:
        announcer.announce(Notice(Path(model_dir).name, str(version), seq, ts))


# ---- a process's notices ---------------------------------------------------------------------------
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
        self.registry.register(_Listening(self))

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


def _discover() -> None:
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")


class _Nothing:
    listening = False

    def close(self) -> None:
        pass


class _Listening:
    """``recserve_notices_listening``: 1 while notices sent now are received (a fact to wait on);
    ``recserve_notice_lag_seconds`` {version, seq}: the last notice's seconds from its marker's write
    to its receipt here (the transport's share of a delta's way into lookups)."""

    def __init__(self, notices: Notices):
        self.notices = notices

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        name = self.notices.transport.name
        g = GaugeMetricFamily(LISTENING, "1 while update notices sent now are received", labels=["transport"])
        g.add_metric([name], float(self.notices.listener.listening))
        yield g
        lag = GaugeMetricFamily(LAG, "Seconds from the last notice's marker write to its receipt",
                                labels=["transport", "version", "seq"])  # fmt: skip
        if (last := self.notices.last) is not None:
            lag.add_metric([name, last[0].version, str(last[0].delta_seq)], last[1])
        yield lag


register(Transport("none", lambda where, model_dir, notices: _Nothing()))
_discover()
