"""File readers (Criteo TSV/CSV, Open Bandit CSV + item_context.csv) -> ``Table``, and the
inverse for clients and tests: a Table's rows as the JSON records a client would send.

These read a whole (small) file into one Table for clients, tests and the demo; they are thin
wrappers over the streaming reader (``features.stream``), which training uses chunk by chunk.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from features.schema import Schema
from features.stream import concat, text_batches, to_table
from features.transform import FeatureError, Table

CRITEO_COLUMNS = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
_BLOCK = 4 << 20


def read_delimited(
    path: str | Path, sep: str, columns: list[str] | None = None, limit: int | None = None
) -> Table:
    """A delimited text file without quoting (gzip if it ends in .gz). ``columns=None``: the first
    line is the header. A line with the wrong number of fields is a FeatureError naming it."""
    tables: list[Table] = []
    rows = 0
    for batch in text_batches(Path(path), sep, tuple(columns) if columns else None, _BLOCK):
        if limit is not None:
            batch = batch.slice(0, limit - rows)
        tables.append(to_table(batch, where=str(path)))
        rows += batch.num_rows
        if limit is not None and rows >= limit:
            break
    return concat(tables)


def read_criteo(path: str | Path, limit: int | None = None) -> Table:
    """Criteo DAC: headerless TSV (label, I1..I13, C1..C26) or the CSV sample with a header."""
    path = Path(path)
    if path.suffix == ".csv":
        return read_delimited(path, ",", None, limit)
    return read_delimited(path, "\t", CRITEO_COLUMNS, limit)


def read_obd(all_csv: str | Path, item_context_csv: str | Path, limit: int | None = None) -> Table:
    """Open Bandit Dataset impressions joined with their item features (by item_id)."""
    log = read_delimited(all_csv, ",", None, limit)
    items = read_delimited(item_context_csv, ",", None)
    item_ids = items.columns["item_id"].astype(np.int64)
    lookup = np.full(item_ids.max() + 1, -1, np.int64)
    lookup[item_ids] = np.arange(len(item_ids))
    log_ids = log.columns["item_id"].astype(np.int64)
    if (log_ids > item_ids.max()).any() or (lookup[log_ids] < 0).any():
        raise FeatureError(f"{all_csv}: item_id without a row in {item_context_csv}")
    rows = lookup[log_ids]
    cols = dict(log.columns)
    for name, col in items.columns.items():
        if name.startswith("item_feature"):
            cols[name] = col[rows]
    return Table(cols, log.num_rows)


def obd_candidates(item_context_csv: str | Path) -> Table:
    """The 80 candidate items of the Open Bandit catalogue (item_id and item features)."""
    return read_delimited(item_context_csv, ",", None)


def to_records(
    table: Table, schema: Schema, rows: slice | None = None, with_label: bool = False
) -> list[dict]:
    """Rows of a Table as flat JSON records, as a client would send them (missing fields left out,
    dense values as numbers). Client-side helper for tests, the demo and load tests."""
    rows = rows or slice(0, table.num_rows)
    kinds = {s.column: s.kind for s in schema.slots}
    names = [c for c in table.columns if c in kinds or (with_label and c == schema.label)]
    out: list[dict] = []
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
