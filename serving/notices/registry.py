"""The transports' registry: a transport is one module of ``serving.notices`` that calls
``register(Transport(...))``, named in a spec as ``<name>[://<where>]``; ``discover`` imports them.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from serving.notices.record import Notice

if TYPE_CHECKING:
    from serving.notices.hub import Notices


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


def discover(package: str) -> None:
    """Import every module of ``package`` (names starting with '_' excepted): each transport there
    registers itself."""
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package}.{module.name}")
