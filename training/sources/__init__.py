"""Data sources: where training rows come from, and their registry.

A source yields its rows as chunks (``types``), each of one kind as its source kind says: a
``TableChunk`` (a Table of a file's rows) or a ``KeyedChunk`` (a stream's samples with the keys the
trainer dedupes on: ``SourceKind.keyed``), with the ``Position`` of its first row (a file or a
stream's partition, and the row in it). It may never end: an unbounded source (a watched
directory; a stream) yields ``TICK`` whenever it looked for rows, so its consumer keeps control
(it cuts deltas, follows a new version) while nothing arrives. What was consumed is the
consumer's ``Ledger`` (``training.sources.ledger``): a source resumes where the ledger says and
skips what it marks failed. A source read in parts (a stream's partitions) lists them as typed
``Part``s, each with its number and its resume ``Position``; torchrun ranks split them by number
(``share``).

A source kind is one module of this package that calls ``register(SourceKind(...))``
(``registry``); the package imports every module in it, so a new source is one file here plus its
test. A spec names its kind
with a scheme (``<kind>://<where>``, e.g. ``watch://incoming/``); one without a scheme is read by
the caller's default kind (``files`` for ``--data``/``--test``, ``watch`` for ``--watch``).
Epochs read a bounded source again every epoch; an unbounded one is for ``--follow``.
"""

from training.sources.registry import KINDS, SourceKind, discover, get, open_source, parse, register, tables
from training.sources.types import (
    TICK,
    Chunk,
    Keyed,
    KeyedChunk,
    Look,
    Part,
    Position,
    Reading,
    Source,
    TableChunk,
    share,
)

__all__ = ["KINDS", "TICK", "Chunk", "Keyed", "KeyedChunk", "Look", "Part", "Position", "Reading", "Source", "SourceKind",
           "TableChunk", "get", "open_source", "parse", "register", "share", "tables"]  # fmt: skip

discover(__name__)
