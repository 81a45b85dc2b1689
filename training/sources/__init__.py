"""Data sources: where training rows come from, and their registry.

A source yields its rows as ``Chunk``s (a Table and the ``Position`` of its first row: a file or
a stream's partition, and the row in it) and may never end: an unbounded source (a watched
directory; a stream) yields ``TICK`` whenever it looked for rows, so its consumer keeps control
(it cuts deltas, follows a new version) while nothing arrives. What was consumed is the
consumer's ``Ledger`` (``training.sources.ledger``): a source resumes where the ledger says and
skips what it marks failed.

A source kind is one module of this package that calls ``register(SourceKind(...))``; the package
imports every module in it, so a new source is one file here plus its test. A spec names its kind
with a scheme (``<kind>://<where>``, e.g. ``watch://incoming/``); one without a scheme is read by
the caller's default kind (``files`` for ``--data``/``--test``, ``watch`` for ``--watch``).
Epochs read a bounded source again every epoch; an unbounded one is for ``--follow``.
"""

from __future__ import annotations

import importlib
import pkgutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from features.schema import Schema
from features.stream import ReadOptions
from features.transform import Table

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from features.batch import CompactBatch
    from stream.sample_batch import Samples
    from training.sources.ledger import Ledger


@dataclass(frozen=True)
class Position:
    """Where rows lie: a unit of a source (a file's name, a stream's partition) and a row in it
    (0-based)."""

    unit: str
    row: int


@dataclass(frozen=True)
class Keyed:
    """Rows that arrive as samples (a stream's), each with the key the trainer dedupes on."""

    samples: Samples
    """Decoded and checked against ``schema``."""
    schema: Schema

    @property
    def keys(self) -> NDArray[np.bytes_]:
        """Per row, its (request, item) key as bytes (equal keys: the same sample)."""
        return self.samples.keys

    @property
    def ts(self) -> NDArray[np.float64]:
        """Per row, when it was served (seconds since the epoch)."""
        return self.samples.ts

    @classmethod
    def join(cls, parts: list[Keyed]) -> Keyed:
        """The rows of ``parts`` (of one schema) in order, as one."""
        from stream.sample_batch import concat

        return parts[0] if len(parts) == 1 else cls(concat([p.samples for p in parts]), parts[0].schema)

    def batch(self, rows: NDArray[np.int64] | None = None) -> CompactBatch:
        """The trainer's batch (with labels) of the rows at ``rows`` (None: all)."""
        from stream.sample_batch import take, to_batch

        return to_batch(self.samples if rows is None else take(self.samples, rows), self.schema)


@dataclass(frozen=True)
class Chunk:
    """Rows of one unit of a source, in order."""

    table: Table
    start: Position
    """Where its first row lies."""
    last: bool = False
    """The unit ends after these rows (the table may be empty: a file's end found after its last
    rows went out)."""
    keyed: Keyed | None = None
    """A stream's rows as a keyed batch (``table`` is then empty)."""
    end: int | None = None
    """Where the unit resumes after this chunk, where that is not ``start.row`` plus its rows (a
    stream's offsets: records refused or skipped lie between)."""
    refused: int = 0
    """Records of the unit in this chunk that were malformed (sent to a dead-letter topic)."""

    @property
    def rows(self) -> int:
        return self.keyed.samples.num_rows if self.keyed is not None else self.table.num_rows

    @property
    def stop(self) -> Position:
        """Where the row after its last lies."""
        return Position(
            self.start.unit, self.start.row + self.table.num_rows if self.end is None else self.end
        )


TICK = Chunk(Table({}, 0), Position("", 0))
"""What an unbounded source yields each time it looked for rows: nothing to train, but the
consumer's turn to do its periodic work."""


@dataclass(frozen=True)
class Reading:
    """What a source is opened with."""

    schema: Schema
    options: ReadOptions = ReadOptions()
    limit: int | None = None
    """Rows read at most (None: all)."""
    part: tuple[int, int] = (0, 1)
    """(rank, world): this rank's share of the rows."""
    columns: list[str] | None = None
    """Read only these columns (None: every column the schema uses)."""
    poll_s: float = 1.0
    """Unbounded sources: seconds between two looks for new rows."""
    once: bool = False
    """Unbounded sources: end once the rows there now are read."""
    batch_rows: int = 1024
    """Streams: records per chunk at most (the follower's batch size: a chunk is one step)."""
    fill_s: float | None = None
    """Streams: the longest one read waits for ``batch_rows`` records before it takes fewer (None:
    ``poll_s``). The follower bounds it by its delta interval: a record must not wait a second
    for a batch to fill when a delta is cut every 0.5 s."""
    wait: Callable[[float], object] = field(default=time.sleep, compare=False)
    """How to wait between two looks (an interruptible wait: ``threading.Event.wait``)."""


class Source(Protocol):
    bounded: bool
    """The rows end, and reading again gives the same rows (epochs and the row-count scan need it)."""

    def chunks(self) -> Iterator[Chunk]:
        """The rows in order (with ``TICK``s where unbounded), from where the ledger says. The
        chunks between two ``TICK``s are the rows of one look (a stream's one consume)."""
        ...

    def behind(self) -> int | None:
        """Rows of the source after those yielded so far, as last seen (a stream's consumer lag,
        summed over its units; None: the source does not know)."""
        ...


@dataclass(frozen=True)
class SourceKind:
    """One registered kind of source."""

    name: str
    """The scheme that names it in a spec (``<name>://...``)."""
    open: Callable[[str, Reading, Ledger | None], Source]
    """``open(where, reading, ledger)``: the source of ``where`` (the spec without its scheme)."""


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
        if chunk.table.num_rows:
            yield chunk.table


def _discover() -> None:
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")


_discover()
