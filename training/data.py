"""Training data: read a split, partition it across ranks, dense statistics, mini-batches.

Batches are transformed once (features.transform, vectorised) and reused every epoch; the epoch
loop only shuffles their order.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from features.batch import CompactBatch
from features.readers import read_criteo, read_delimited
from features.schema import Schema, with_stats
from features.transform import Table, dense_matrix, transform


def read_split(path: str | Path, schema: Schema, limit: int | None = None) -> Table:
    """A Criteo TSV (headerless, by the schema name or suffix) or a CSV with a header."""
    path = Path(path)
    if schema.name == "criteo" or path.suffix in (".tsv", ".txt"):
        return read_criteo(path, limit)
    return read_delimited(path, ",", None, limit)


def take(table: Table, rows: np.ndarray | slice) -> Table:
    """The given rows of a table (a slice is a view, an index array a copy)."""
    cols = {k: v[rows] for k, v in table.columns.items()}
    n = len(next(iter(cols.values()))) if cols else 0
    return Table(cols, n)


def shuffle(table: Table, seed: int) -> Table:
    return take(table, np.random.default_rng(seed).permutation(table.num_rows))


def partition(table: Table, rank: int, world_size: int) -> Table:
    """Rank ``rank``'s contiguous block; every rank gets the same number of rows (the remainder
    is dropped) so every rank runs the same number of DDP steps."""
    per = table.num_rows // world_size
    return take(table, slice(rank * per, (rank + 1) * per))


def dense_stats(table: Table, schema: Schema) -> dict[str, tuple[float, float]]:
    """Mean and std of every dense feature after the schema's own transform (clip/log1p)."""
    if not schema.dense:
        return {}
    x = dense_matrix(transform(table, schema), schema).astype(np.float64)
    mean, std = x.mean(axis=0), x.std(axis=0)
    std[~(std > 1e-6)] = 1.0
    return {s.name: (float(m), float(d)) for s, m, d in zip(schema.dense, mean, std, strict=True)}


def standardised(schema: Schema, table: Table) -> Schema:
    """The schema with dense mean/std from ``table`` (what serving then applies too)."""
    return with_stats(schema, dense_stats(table, schema))


def batches(table: Table, schema: Schema, batch_size: int) -> list[CompactBatch]:
    """The table as transformed mini-batches of ``batch_size`` rows (the last may be shorter)."""
    return [
        transform(take(table, slice(a, min(a + batch_size, table.num_rows))), schema)
        for a in range(0, table.num_rows, batch_size)
    ]
