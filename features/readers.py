"""Client-side helpers over the one reader (``features.stream``): the Open Bandit log joined with
its item features, and the inverse of reading, a Table's rows as the JSON records a client sends.

Every data file is read by ``features.stream`` (its ``stream`` chunk by chunk, its ``read``
for a small file at once); nothing here parses a file itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from features import stream
from features.schema import Schema
from features.transform import FeatureError, Table


def join_items(log: Table, items: Table, items_name: str = "the item table") -> Table:
    """Open Bandit rows (``item_id`` per row) with the item features of ``items`` (by item_id)."""
    item_ids = items.columns["item_id"].astype(np.int64)
    lookup = np.full(item_ids.max() + 1, -1, np.int64)
    lookup[item_ids] = np.arange(len(item_ids))
    log_ids = log.columns["item_id"].astype(np.int64)
    if (log_ids > item_ids.max()).any() or (lookup[log_ids] < 0).any():
        raise FeatureError(f"an item_id without a row in {items_name}")
    rows = lookup[log_ids]
    cols = dict(log.columns)
    for name, col in items.columns.items():
        if name.startswith("item_feature"):
            cols[name] = col[rows]
    return Table(cols, log.num_rows)


def read_obd(
    all_csv: str | Path, item_context_csv: str | Path, schema: Schema, limit: int | None = None
) -> Table:
    """Open Bandit Dataset impressions joined with their item features (by item_id)."""
    log = stream.read(all_csv, schema, limit=limit)
    return join_items(log, stream.read(item_context_csv, schema), str(item_context_csv))


def to_records(
    table: Table, schema: Schema, rows: slice | None = None, with_label: bool = False
) -> list[dict[str, Any]]:
    """Rows of a Table as flat JSON records, as a client would send them (missing fields left out,
    dense values as numbers). Client-side helper for tests, the demo and load tests."""
    rows = rows or slice(0, table.num_rows)
    kinds = {s.column: s.kind for s in schema.slots}
    names = [c for c in table.columns if c in kinds or (with_label and c == schema.label)]
    out: list[dict[str, Any]] = []
    cols = {c: table.columns[c][rows].tolist() for c in names}
    for i in range(len(next(iter(cols.values()))) if cols else 0):
        rec = {}
        for c in names:
            v = cols[c][i]
            if v == "":
                continue
            rec[c] = float(v) if kinds.get(c) == "dense" or c == schema.label else v
        out.append(rec)
    return out
