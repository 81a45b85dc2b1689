"""One row of a compact batch as a training sample carries it: per slot the signs of that row.

A compact batch stores each slot's unique signs once and per row indices into them (context slots
once for the whole batch). A sample is one (request, item), so it carries that item's row with the
signs themselves: for every slot, ``lengths[s]`` signs (1 for a single-valued slot; a context
slot's signs are the request's, the same in every row), the row's per-row dense values and the
request's context dense values. ``RowTable.of(batch)`` lays out every row of a batch at once
(numpy, one pass per slot, no loop per row); ``row_parts(r)`` are then slices of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from features.batch import FLAG_CONTEXT, FLAG_MULTI, CompactBatch


@dataclass(frozen=True)
class RowTable:
    """Every row of one batch, signs grouped by row then slot (``signs[starts[r]:starts[r+1]]``)."""

    schema_hash: int
    flags: NDArray[np.uint8]  # (S,) the batch's slot flags (FLAG_CONTEXT, FLAG_MULTI)
    lengths: NDArray[np.uint32]  # (N, S) signs of row r in slot s
    starts: NDArray[np.int64]  # (N + 1,) where row r's signs begin in ``signs``
    signs: NDArray[np.uint64]  # every row's signs, row after row, slot after slot within a row
    dense: NDArray[np.float32]  # (N, F_row)
    context_dense: NDArray[np.float32]  # (F_ctx,)

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @classmethod
    def of(cls, batch: CompactBatch) -> RowTable:
        n, flags = batch.num_rows, np.asarray(batch.flags, np.uint8)
        context, multi = (flags & FLAG_CONTEXT) > 0, (flags & FLAG_MULTI) > 0
        # (row r, slot s) holds a run of lengths[r, s] of the batch's values from first[r, s]; its
        # stored row is r, or 0 in a context slot (stored once)
        stored = np.arange(n)[:, None] * ~context
        value_start = batch.value_splits[:-1]
        first = value_start + stored
        lengths = np.ones((n, len(flags)), np.int64)
        if multi.any():  # the multi-valued slots' offsets, slot after slot, rows_s + 1 each
            count = np.where(context[multi], 1, n) + 1
            at = (np.cumsum(count) - count) + stored[:, multi]
            offsets = batch.offsets.astype(np.int64)
            first[:, multi] = value_start[multi] + offsets[at]
            lengths[:, multi] = offsets[at + 1] - offsets[at]
        starts = np.zeros(n + 1, np.int64)
        np.cumsum(lengths.sum(axis=1), out=starts[1:])
        runs, sizes = first.ravel(), lengths.ravel()  # row after row, slot after slot
        values = np.repeat(runs - (np.cumsum(sizes) - sizes), sizes) + np.arange(int(starts[-1]))
        return cls(
            schema_hash=int(batch.schema_hash),
            flags=flags,
            lengths=lengths.astype(np.uint32),
            starts=starts,
            signs=batch.signs[batch.global_values()[values]],
            dense=np.ascontiguousarray(batch.dense, np.float32).reshape(n, -1),
            context_dense=np.ascontiguousarray(batch.context_dense, np.float32),
        )

    def row(self, r: int) -> Row:
        return Row(
            schema_hash=self.schema_hash,
            flags=self.flags,
            lengths=self.lengths[r],
            signs=self.signs[self.starts[r] : self.starts[r + 1]],
            dense=self.dense[r],
            context_dense=self.context_dense,
        )


@dataclass(frozen=True, eq=False)
class Row:
    """One item's row: per slot ``lengths[s]`` signs (``signs`` holds them slot after slot)."""

    schema_hash: int
    flags: NDArray[np.uint8]
    lengths: NDArray[np.uint32]
    signs: NDArray[np.uint64]
    dense: NDArray[np.float32]
    context_dense: NDArray[np.float32]

    def slot_signs(self, s: int) -> NDArray[np.uint64]:
        ends = np.cumsum(self.lengths.astype(np.int64))
        return self.signs[ends[s] - int(self.lengths[s]) : ends[s]]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Row):
            return NotImplemented
        return self.schema_hash == other.schema_hash and all(
            np.array_equal(getattr(self, f), getattr(other, f))
            for f in ("flags", "lengths", "signs", "dense", "context_dense")
        )

    __hash__ = None  # type: ignore[assignment]  # mutable arrays inside


__all__ = ["FLAG_CONTEXT", "FLAG_MULTI", "Row", "RowTable"]
