"""Training data, streamed: files -> chunks -> (shuffle buffer) -> mini-batches -> CompactBatches.

Nothing holds a whole file. Every epoch re-reads the source (a registered data source,
``training.sources``; without a scheme, files: TSV/CSV with or without a header, Parquet, gzip,
directories and globs) chunk by chunk; a bounded shuffle
buffer mixes rows; each mini-batch is transformed on its own (``features.transform``,
vectorised), on a background thread so reading overlaps the training step. Under DDP each rank
reads its own pieces of the rows (``part=(rank, world)``).

One streaming pass before training (``scan``) counts every rank's rows, so that all ranks agree on
the number of steps per epoch (DDP needs equal step counts), and accumulates the dense features'
moments (float64, merged exactly across chunks and ranks) for the standardisation statistics.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from features import stream
from features.batch import CompactBatch
from features.schema import Schema, load_schema
from features.stream import ReadOptions
from features.transform import Table, dense_matrix, transform
from training import sources
from training.ranks import all_ranks
from training.sources import Reading

if TYPE_CHECKING:
    from training.config import TrainConfig


log = logging.getLogger("recserve.train")


def take(table: Table, rows: np.ndarray | slice) -> Table:
    """The given rows of a table (a slice is a view, an index array a copy)."""
    cols = {k: v[rows] for k, v in table.columns.items()}
    n = len(next(iter(cols.values()))) if cols else 0
    return Table(cols, n)


def concat(tables: list[Table]) -> Table:
    return tables[0] if len(tables) == 1 else stream.concat(tables)


# ---- one pass: rows per rank and dense moments -------------------------------------------------
@dataclass
class Scan:
    """Rows read by one rank (or by all, merged) and the moments of each transformed dense feature."""

    rows: int
    mean: np.ndarray  # (F,) float64
    m2: np.ndarray  # (F,) float64: sum of squared deviations from the mean

    def merge(self, other: Scan) -> Scan:
        """Both parts together (Chan et al.'s pairwise update: exact, no catastrophic cancellation)."""
        n = self.rows + other.rows
        if not n:
            return self
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.rows / n)
        m2 = self.m2 + other.m2 + delta**2 * (self.rows * other.rows / n)
        return Scan(n, mean, m2)

    def stats(self, schema: Schema) -> dict[str, tuple[float, float]]:
        """(mean, std) per dense slot; a constant feature gets std 1."""
        std = np.sqrt(self.m2 / max(self.rows, 1))
        std[~(std > 1e-6)] = 1.0
        return {s.name: (float(m), float(d)) for s, m, d in zip(schema.dense, self.mean, std, strict=True)}


def scan(
    source: str | Path,
    schema: Schema,
    options: ReadOptions,
    limit: int | None = None,
    part: tuple[int, int] = (0, 1),
) -> Scan:
    """Count this rank's rows and accumulate its dense features' moments after the schema's own
    transform (clip/log1p), reading only the dense columns."""
    dense_only = dataclasses.replace(schema, slots=schema.dense, crosses=(), label=None)
    columns = [s.column for s in schema.dense]
    total = Scan(0, np.zeros(len(columns)), np.zeros(len(columns)))
    reading = Reading(schema, options, limit, part, columns)
    for table in sources.tables(str(source), reading):
        x = dense_matrix(transform(table, dense_only), dense_only).astype(np.float64)
        mean = x.mean(axis=0) if len(x) else np.zeros(len(columns))
        total = total.merge(Scan(len(x), mean, ((x - mean) ** 2).sum(axis=0)))
    return total


# ---- rows -> mini-batches -----------------------------------------------------------------------
def shuffled(tables: Iterable[Table], buffer_rows: int, rng: np.random.Generator) -> Iterator[Table]:
    """The rows of ``tables`` mixed within a window of ``buffer_rows``: the buffer fills, is
    permuted as a whole (vectorised), its first half goes out, the rest waits for the next fill.
    The input tables are consumed (their columns are released as the buffer is mixed)."""
    pending: list[Table] = []
    n = 0
    for t in tables:
        pending.append(t)
        n += t.num_rows
        if n >= buffer_rows:
            mixed = _permuted(pending, n, rng)
            keep = buffer_rows // 2
            yield take(mixed, slice(keep, None))
            pending, n = [take(mixed, np.arange(keep))], keep  # a copy: the old buffer can go
            del mixed
    if n:
        yield _permuted(pending, n, rng)


def _permuted(tables: list[Table], n: int, rng: np.random.Generator) -> Table:
    """The rows of ``tables`` in a random order, built column by column while the tables' own
    columns are released (about one buffer of extra memory, not two)."""
    order = rng.permutation(n)
    cols = {}
    for name in list(tables[0].columns):
        cols[name] = np.concatenate([t.columns.pop(name) for t in tables])[order]
    return Table(cols, n)


def rebatch(tables: Iterable[Table], size: int) -> Iterator[Table]:
    """The same rows in tables of exactly ``size`` rows (the last may be shorter)."""
    pending: list[Table] = []
    n = 0
    for t in tables:
        start = 0
        while n + t.num_rows - start >= size:
            pending.append(take(t, slice(start, start + size - n)))
            start += size - n
            yield concat(pending)
            pending, n = [], 0
        if start < t.num_rows:
            pending.append(take(t, slice(start, None)))
            n += t.num_rows - start
    if n:
        yield concat(pending)


def batches(table: Table, schema: Schema, batch_size: int) -> list[CompactBatch]:
    """A (small, whole) table as transformed mini-batches of ``batch_size`` rows."""
    return [transform(t, schema) for t in rebatch([table], batch_size)]


@dataclass(frozen=True)
class Split:
    """A bounded data source as the trainer streams it: this rank's part of its first ``limit`` rows."""

    source: str | Path  # a source spec (training.sources): a file, directory or glob, or <kind>://...
    schema: Schema
    options: ReadOptions
    limit: int | None = None
    part: tuple[int, int] = (0, 1)  # (rank, world size)

    def tables(self) -> Iterator[Table]:
        reading = Reading(self.schema, self.options, self.limit, self.part)
        return sources.tables(str(self.source), reading)

    def scan(self) -> Scan:
        return scan(self.source, self.schema, self.options, self.limit, self.part)

    def batches(
        self,
        batch_size: int,
        shuffle_buffer: int = 0,
        rng: np.random.Generator | None = None,
        steps: int | None = None,
        skip: int = 0,
    ) -> Iterator[CompactBatch]:
        """One pass as transformed mini-batches of ``batch_size`` rows, at most ``steps`` of them;
        rows mixed by a buffer of ``shuffle_buffer`` rows when it is > 1 and an rng is given. The
        first ``skip`` batches are read but not transformed nor yielded (a resumed run's position:
        the same rng gives the same order)."""
        tables = self.tables()
        if shuffle_buffer > 1 and rng is not None:
            tables = shuffled(tables, shuffle_buffer, rng)
        for i, t in enumerate(rebatch(tables, batch_size)):
            if steps is not None and i >= steps:
                return
            if i >= skip:
                yield transform(t, self.schema)


def in_background(items: Iterable, depth: int = 4) -> Generator:
    """``items`` produced on a thread, at most ``depth`` ahead (Arrow's parser, numpy and the
    compiled kernels release the GIL, so reading overlaps the training step). An exception is
    re-raised here; leaving the loop early stops the thread."""
    q: queue.Queue = queue.Queue(depth)
    stop = threading.Event()
    end = object()

    def put(entry) -> bool:
        while not stop.is_set():
            try:
                q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((end, None))
        except BaseException as e:  # handed to the consumer
            put((end, e))

    thread = threading.Thread(target=produce, name="data", daemon=True)
    thread.start()
    try:
        while True:
            item, error = q.get()
            if item is end:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stop.set()
        thread.join()


# ---- data: streamed every epoch; one pass first counts every rank's rows and dense moments ----
@dataclass
class JobData:
    """The job's rows: the schema (the file as loaded: the feature contract, fingerprinted), this
    rank's part of the training source, the test source, every rank's scan."""

    schema: Schema
    read: ReadOptions
    train: Split
    test: Split
    scans: list[Scan]
    steps_per_epoch: int
    """DDP needs the same number of steps on every rank: the ranks with more rows drop the rest."""


def read_job(cfg: TrainConfig, rank: int, world: int) -> JobData:
    """The job's data for ``rank`` of ``world``: one scan pass of every rank's part first."""
    schema = load_schema(cfg.schema)
    read = ReadOptions(format=cfg.data_format, block_size=cfg.block_size, numeric_dense=True)
    train_split = Split(cfg.data, schema, read, cfg.limit, part=(rank, world))
    scans = all_ranks(train_split.scan(), world)
    steps_per_epoch = min(-(-s.rows // cfg.batch_size) for s in scans)
    if steps_per_epoch == 0:
        raise ValueError(
            f"{cfg.data}: no training rows" + (f" for one of the {world} ranks" if world > 1 else "")
        )
    log.info(
        "rank %d/%d: %d training rows, %d steps per epoch", rank, world, scans[rank].rows, steps_per_epoch
    )
    return JobData(schema, read, train_split, Split(cfg.test, schema, read), scans, steps_per_epoch)
