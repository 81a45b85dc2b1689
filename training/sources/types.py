"""The nouns of a data source: where rows lie (``Position``), the parts ranks split (``Part``),
the two kinds of chunk (a table's rows, ``TableChunk``; a stream's keyed samples, ``KeyedChunk``),
what a source is opened with (``Reading``) and what it offers (``Source``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, TypeAlias

from features.schema import Schema
from features.stream import ReadOptions
from features.transform import Table

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

    from features.batch import CompactBatch
    from stream.sample_batch import Samples


class Consumed(Protocol):
    """What a resume reads of a ledger (``training.sources.ledger.Ledger``, which records chunks
    of these nouns): the rows consumed of a unit."""

    def row(self, unit: str) -> int: ...


@dataclass(frozen=True)
class Position:
    """Where rows lie: a unit of a source (a file's name, a stream's partition) and a row in it
    (0-based)."""

    unit: str
    row: int


@dataclass(frozen=True)
class Part:
    """One part of a source that reads on its own (a stream's partition): what torchrun ranks
    split, by number, so no rank parses a unit's name."""

    unit: str
    """Its name in the ledger and in a delta record's positions (a partition: ``<topic>/<n>``)."""
    index: int
    """Its number in the source (a partition's number): rank r of w reads those with index % w == r."""

    def resume(self, ledger: Consumed) -> Position:
        """Where reading it resumes: the ledger's row (a stream's offset; 0: from its start)."""
        return Position(self.unit, ledger.row(self.unit))


def share(parts: list[Part], rank: int, world: int) -> list[Part]:
    """The parts rank ``rank`` of ``world`` reads: those whose index % world == rank."""
    return [p for p in parts if p.index % world == rank]


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
        """Per row, when it was labelled (event time, seconds since the epoch: served, plus the
        label's delay): the trained keys' window runs on it, so a correction an hour after its
        impression is remembered as long as a first label."""
        return self.samples.ts + self.samples.elapsed

    @property
    def kinds(self) -> NDArray[np.uint8]:
        """Per row, a first label or a correction (``stream.records`` LABEL, CORRECTION)."""
        return self.samples.kinds

    @classmethod
    def join(cls, parts: list[Keyed]) -> Keyed:
        """The rows of ``parts`` (of one schema) in order, as one."""
        from stream.sample_batch import concat

        return parts[0] if len(parts) == 1 else cls(concat([p.samples for p in parts]), parts[0].schema)

    @property
    def num_rows(self) -> int:
        return self.samples.num_rows

    def batch(self, rows: NDArray[np.int64] | None = None) -> CompactBatch:
        """The trainer's batch (with labels) of the rows at ``rows`` (None: all)."""
        from stream.sample_batch import take, to_batch

        return to_batch(self.samples if rows is None else take(self.samples, rows), self.schema)


class KeyedSpan(Keyed):
    """Rows ``lo`` to ``hi`` of ``whole``'s samples, cut (``stream.sample_batch.span``) only when
    they are read: a stream's chunk of a look whose step takes the whole look never is."""

    _span: tuple[Samples, int, int]

    def __init__(self, whole: Keyed, lo: int, hi: int) -> None:
        object.__setattr__(self, "schema", whole.schema)
        object.__setattr__(self, "_span", (whole.samples, lo, hi))

    @property  # Keyed's field, computed here
    def samples(self) -> Samples:
        from stream.sample_batch import span

        cut = self.__dict__.get("_cut")
        if cut is None:
            cut = span(*self._span)
            object.__setattr__(self, "_cut", cut)
        return cut

    @property
    def num_rows(self) -> int:
        _, lo, hi = self._span
        return hi - lo


@dataclass(frozen=True)
class TableChunk:
    """Rows of one unit of a source (a file's), in order, as a table."""

    table: Table
    start: Position
    """Where its first row lies."""
    last: bool = False
    """The unit ends after these rows (the table may be empty: a file's end found after its last
    rows went out)."""

    @property
    def rows(self) -> int:
        return self.table.num_rows

    @property
    def stop(self) -> Position:
        """Where the row after its last lies."""
        return Position(self.start.unit, self.start.row + self.table.num_rows)


@dataclass(eq=False)
class Look:
    """The samples of one look of a stream (every partition's chunk of one consume, in the order
    they are yielded) with their batch, built on the reading thread: a step that takes the whole
    look as it is (no sample dropped as trained already) uses them as they are."""

    keyed: Keyed
    chunks: int
    """The chunks it was yielded as."""
    batch: CompactBatch | None
    """The trainer's batch of every sample (None: none fits)."""
    after: tuple[CompactBatch, ...] = ()
    """The batches of the looks read after it, as they stood when it was yielded: the trainer
    looks their rows up during its step (``TrainCtx.upcoming``)."""


@dataclass(frozen=True)
class KeyedChunk:
    """Records of one unit of a stream (a partition's), in order, as keyed samples."""

    keyed: Keyed
    start: Position
    """Where its first record lies (its offset)."""
    end: int
    """Where the unit resumes after this chunk (the offset after its last record: records refused
    lie between)."""
    refused: int = 0
    """Records of the unit in this chunk that were malformed (sent to a dead-letter topic)."""
    look: Look | None = field(default=None, compare=False)
    """The look it is a part of, when the source built one."""

    @property
    def rows(self) -> int:
        return self.keyed.num_rows

    @property
    def stop(self) -> Position:
        """Where the record after its last lies."""
        return Position(self.start.unit, self.end)


Chunk: TypeAlias = TableChunk | KeyedChunk
"""Rows of one unit of a source: a source kind yields one of the two (``SourceKind.keyed``)."""

TICK = TableChunk(Table({}, 0), Position("", 0))
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

    def skipped(self) -> int:
        """Records the source found gone and read past, since it opened (a stream's offsets the
        broker's retention dropped before they were read, or its control records): 0 elsewhere."""
        ...

    def list_parts(self) -> list[Part]:
        """Every part of the source that reads on its own, in index order (a stream's
        partitions: torchrun ranks split them, ``share``); [] for a source one process reads."""
        ...
