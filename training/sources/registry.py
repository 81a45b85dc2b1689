"""The source kinds' registry: a kind is one module of ``training.sources`` that calls
``register(SourceKind(...))``; ``discover`` imports them. A spec names its kind with a scheme
(``<kind>://<where>``); one without is read by the caller's default kind.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from features.transform import Table
from training.sources.types import Reading, Source, TableChunk

if TYPE_CHECKING:
    from training.sources.ledger import Ledger


@dataclass(frozen=True)
class SourceKind:
    """One registered kind of source."""

    name: str
    """The scheme that names it in a spec (``<name>://...``)."""
    open: Callable[[str, Reading, Ledger | None], Source]
    """``open(where, reading, ledger)``: the source of ``where`` (the spec without its scheme)."""
    keyed: bool = False
    """Its chunks are ``KeyedChunk``s: samples with the key the trainer dedupes on (a stream of
    ``recserve join``'s samples); else ``TableChunk``s."""


KINDS: dict[str, SourceKind] = {}
"""Every registered source kind by name."""


def register(kind: SourceKind) -> SourceKind:
    """Add ``kind`` to the registry (a name registered twice is a ValueError)."""
    if kind.name in KINDS:
        raise ValueError(f"data source {kind.name!r} registered twice")
    KINDS[kind.name] = kind
    return kind


def get(name: str) -> SourceKind:
    """The kind registered as ``name``; a ValueError naming the known ones otherwise."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown data source {name!r}; known sources: {', '.join(KINDS)}") from None


def parse(spec: str, default: str) -> tuple[SourceKind, str]:
    """(kind, where) of ``spec``: ``<kind>://<where>``, else ``default`` reads all of it."""
    scheme, sep, where = spec.partition("://")
    return (get(scheme), where) if sep else (get(default), spec)


def open_source(spec: str, reading: Reading, default: str, ledger: Ledger | None = None) -> Source:
    """The source ``spec`` names (see ``parse``), opened."""
    kind, where = parse(spec, default)
    return kind.open(where, reading, ledger)


def tables(spec: str, reading: Reading, default: str = "files") -> Iterator[Table]:
    """The non-empty Tables of the bounded source ``spec`` names (what an epoch reads); a
    ValueError naming the way out for an unbounded one."""
    kind, where = parse(spec, default)
    source = kind.open(where, reading, None)
    if not source.bounded:
        raise ValueError(
            f"{spec}: {kind.name} is an unbounded source and cannot be read in epochs; follow it (--follow)"
        )
    for chunk in source.chunks():
        if isinstance(chunk, TableChunk) and chunk.table.num_rows:
            yield chunk.table


def discover(package: str) -> None:
    """Import every module of ``package`` (names starting with '_' excepted): each source kind
    there registers itself."""
    for module in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package}.{module.name}")
