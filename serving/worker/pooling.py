"""Pooling of looked-up rows into one vector per (row, slot), and its exact adjoint.

A batch is pooled through *cells*: one cell per (row, item slot), row-major, followed by one cell
per context slot (stored once, broadcast to every row at the end). The batch's values are
reordered once into cell order, so that pooling is one gather (``table[value_sign]``) plus one
``np.add.reduceat`` over the cells, and the backward pass is the same two steps transposed.
No Python loop runs per row or per value; the plan loops once per slot.

For the common all-single, no-context batch (Criteo) every cell holds exactly one value: pooling
is a single gather and needs no reduction.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from features.batch import FLAG_CONTEXT, FLAG_MULTI, BatchError, CompactBatch, check_fits
from features.schema import Schema

__all__ = ["BatchError", "PoolingPlan", "make_plan", "pool", "unpool_signs"]


@dataclass
class PoolingPlan:
    """How one batch's values map to pooled cells (computed once per forward)."""

    num_rows: int
    num_slots: int
    item: np.ndarray
    """bool (num_slots,): True for per-row slots, False for context slots (stored once)."""
    value_sign: np.ndarray
    """int64 per value, in cell order: its index into ``batch.signs``."""
    value_cell: np.ndarray | None
    """int64 per value, in cell order: its cell (None: value i is cell i)."""
    cell_starts: np.ndarray | None
    """Start of each non-empty cell's values, for reduceat (None: one value per cell)."""
    nonempty: np.ndarray | None
    """bool per cell (None: every cell is non-empty)."""
    divisor: np.ndarray | None
    """float32 per cell: its length for mean-pooled cells, 1 otherwise (None: all sum)."""

    @property
    def num_cells(self) -> int:
        n_item = int(self.item.sum())
        return self.num_rows * n_item + (self.num_slots - n_item)


def _mean_slots(schema: Schema) -> np.ndarray:
    return np.array([getattr(f, "pooling", "sum") == "mean" for f in schema.sparse], dtype=bool)


def make_plan(batch: CompactBatch, schema: Schema) -> PoolingPlan:
    """Validate ``batch`` against ``schema`` and compute its pooling plan."""
    check_fits(batch, schema)
    R, S = int(batch.num_rows), int(batch.num_slots)
    flags = np.asarray(batch.flags)
    item = (flags & FLAG_CONTEXT) == 0
    multi = (flags & FLAG_MULTI) != 0
    value_counts = np.asarray(batch.value_counts, dtype=np.int64)
    gv = batch.global_values()
    if len(gv) and (gv.min() < 0 or gv.max() >= len(batch.signs)):
        raise BatchError("batch values index outside its signs")

    if item.all() and not multi.any():  # fast path: one value per (row, slot), values slot-major
        if not (value_counts == R).all():
            bad = int(np.flatnonzero(value_counts != R)[0])
            raise BatchError(f"slot {bad} has {value_counts[bad]} values for {R} rows")
        return PoolingPlan(R, S, item, gv.reshape(S, R).T.ravel(), None, None, None, None)

    n_item = int(item.sum())
    ctx_base = R * n_item
    n_cells = ctx_base + (S - n_item)
    item_pos = np.cumsum(item) - 1
    ctx_pos = np.cumsum(~item) - 1
    mean = _mean_slots(schema)
    cell = np.empty(len(gv), dtype=np.int64)
    mean_cells = np.zeros(n_cells, dtype=bool) if mean[multi].any() else None
    splits = np.concatenate(([0], np.cumsum(value_counts)))
    offsets = np.asarray(batch.offsets, dtype=np.int64)
    op = 0  # read position in the concatenated offsets of multi slots
    row_base = np.arange(R, dtype=np.int64) * n_item
    for s in range(S):
        rows_s = R if item[s] else 1
        first = row_base + item_pos[s] if item[s] else np.array([ctx_base + ctx_pos[s]], dtype=np.int64)
        n_vals = int(value_counts[s])
        if multi[s]:
            off = offsets[op : op + rows_s + 1]
            op += rows_s + 1
            if len(off) != rows_s + 1 or off[0] != 0 or off[-1] != n_vals or (np.diff(off) < 0).any():
                raise BatchError(f"slot {s}: offsets do not cover its {n_vals} values over {rows_s} rows")
            cell[splits[s] : splits[s + 1]] = np.repeat(first, np.diff(off))
            if mean_cells is not None and mean[s]:
                mean_cells[first] = True
        else:
            if n_vals != rows_s:
                raise BatchError(f"slot {s} has {n_vals} values for {rows_s} stored rows")
            cell[splits[s] : splits[s + 1]] = first
    if op != len(offsets):
        raise BatchError(f"batch has {len(offsets)} offsets, its multi slots use {op}")

    order = np.argsort(cell, kind="stable")
    counts = np.bincount(cell, minlength=n_cells)
    value_cell = cell[order]
    if (counts == 1).all():
        cell_starts = nonempty = None
    else:
        nonempty = counts > 0
        cell_starts = (np.cumsum(counts) - counts)[nonempty]
    divisor = None
    if mean_cells is not None:
        divisor = np.where(mean_cells & (counts > 1), counts, 1).astype(np.float32)
    return PoolingPlan(R, S, item, gv[order], value_cell, cell_starts, nonempty, divisor)


def pool(plan: PoolingPlan, table: np.ndarray) -> np.ndarray:
    """Pooled embeddings float32 (num_rows, num_slots, dim), C-contiguous, from the batch's
    looked-up rows ``table`` (n_signs, dim) in ``batch.signs`` order."""
    dim = table.shape[1]
    vals: np.ndarray = table[plan.value_sign]  # numpy types fancy indexing as Any
    if plan.cell_starts is None:
        cells = vals
    else:
        cells = np.zeros((plan.num_cells, dim), dtype=np.float32)
        if len(plan.cell_starts):
            cells[plan.nonempty] = np.add.reduceat(vals, plan.cell_starts, axis=0)
    if plan.divisor is not None:
        cells /= plan.divisor[:, None]
    R, S = plan.num_rows, plan.num_slots
    if plan.item.all():
        return cells.reshape(R, S, dim)
    out = np.empty((R, S, dim), dtype=np.float32)
    n_item = int(plan.item.sum())
    out[:, plan.item] = cells[: R * n_item].reshape(R, n_item, dim)
    out[:, ~plan.item] = cells[R * n_item :][None]
    return out


def unpool_signs(plan: PoolingPlan, grads: np.ndarray, num_signs: int) -> tuple[np.ndarray, np.ndarray]:
    """The adjoint of ``pool`` over all ``num_signs`` signs of the batch: (float32 (num_signs, dim)
    summed gradients in ``batch.signs`` order, bool (num_signs,) which signs the batch uses).
    Context cells receive the sum over rows; mean cells divide by length. One compiled pass
    (``features.kernels.scatter_cells``, imported here: serving never calls it)."""
    from features.kernels import scatter_cells

    R, S, dim = grads.shape
    if plan.item.all():
        cell_grads = grads.reshape(R * S, dim)
    else:
        cell_grads = np.concatenate(
            (grads[:, plan.item].reshape(-1, dim), grads[:, ~plan.item].sum(axis=0, dtype=np.float32))
        )
    if plan.divisor is not None:
        cell_grads = cell_grads / plan.divisor[:, None]
    cells = np.ascontiguousarray(cell_grads, np.float32)
    value_cell = _NO_CELLS if plan.value_cell is None else plan.value_cell
    return scatter_cells(plan.value_sign, value_cell, cells, num_signs)


_NO_CELLS = np.empty(0, np.int64)
