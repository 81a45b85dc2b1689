"""CompactBatch: the deduplicated, jagged batch that every hop carries.

Layout (all slots concatenated, slot order = ``Schema.sparse``):

- ``signs``    uint64, per slot the sorted unique signs of that slot, slot after slot;
  ``sign_counts[s]`` of them belong to slot ``s``.
- ``values``   per slot, one index per value into that slot's own signs (narrowest unsigned
  type that fits the largest slot); ``value_counts[s]`` of them belong to slot ``s``.
- ``offsets``  uint32, for each multi-valued slot in order, ``rows_s + 1`` offsets into its values.
- ``flags``    uint8 per slot: FLAG_CONTEXT (stored once for the batch), FLAG_MULTI.
- ``dense``    float32 (num_rows, F_row): per-row dense features. When the batch carries a request
  context (``has_context``), context-scoped dense features are in ``context_dense`` (F_ctx,) once.
- ``labels``   float32 (num_rows,) or None.

A single-valued slot has exactly one value per stored row (``rows_s`` = 1 for a context slot,
``num_rows`` otherwise). Because signs carry their slot id in the top bits, the concatenated
``signs`` are unique across the whole batch: one lookup serves every slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from numpy.typing import ArrayLike, NDArray

if TYPE_CHECKING:
    from features.schema import Schema

FLAG_CONTEXT = 1
FLAG_MULTI = 2


class BatchError(ValueError):
    """A batch that does not fit a schema; the message names the problem."""


def check_fits(batch: CompactBatch, schema: Schema) -> None:
    """The one check that ``batch`` was built for ``schema``: its sparse slot count, its schema
    hash (when it names one) and its dense widths (per row, and once for a request context). The
    worker's pooling plan and the scoring core both run it: a batch of another shape is the
    client's mistake (BatchError: INVALID_ARGUMENT, HTTP 400), never a failure further down."""
    if batch.num_slots != len(schema.sparse):
        raise BatchError(
            f"batch has {batch.num_slots} sparse slots, schema {schema.name!r} has {len(schema.sparse)}"
        )
    if batch.schema_hash and batch.schema_hash != schema.hash64:
        raise BatchError(
            f"batch was built for schema hash {batch.schema_hash:016x}, "
            f"this model serves {schema.name!r} ({schema.hash64:016x})"
        )
    once = sum(s.scope == "context" for s in schema.dense) if batch.has_context else 0
    per_row = int(batch.dense.shape[1]) if batch.dense.ndim == 2 else -1
    if per_row != len(schema.dense) - once or len(batch.context_dense) != once:
        where = f" ({once} of them once per request context)" if batch.has_context else ""
        raise BatchError(
            f"batch has {per_row} dense columns per row and {len(batch.context_dense)} per context, "
            f"schema {schema.name!r} has {len(schema.dense)} dense features{where}"
        )


def index_dtype(max_count: int) -> np.dtype[np.unsignedinteger[Any]]:
    """Narrowest unsigned type whose values index ``max_count`` signs."""
    if max_count <= 1 << 8:
        return np.dtype(np.uint8)
    if max_count <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


def _as_matrix(dense: ArrayLike, num_rows: int) -> NDArray[np.float32]:
    dense = np.ascontiguousarray(dense, dtype=np.float32)
    return dense if dense.ndim == 2 else dense.reshape(num_rows, -1)


class SlotView(NamedTuple):
    signs: NDArray[np.uint64]  # sorted unique
    values: NDArray[np.unsignedinteger[Any]]  # indices into signs, one per value
    offsets: NDArray[np.uint32] | None  # multi-valued: rows_s + 1 offsets into values
    context: bool  # stored once for the whole batch


@dataclass(eq=False)
class CompactBatch:
    num_rows: int
    flags: NDArray[np.uint8]
    sign_counts: NDArray[np.uint32]
    value_counts: NDArray[np.uint32]
    signs: NDArray[np.uint64]
    values: NDArray[np.unsignedinteger[Any]]
    offsets: NDArray[np.uint32]
    dense: NDArray[np.float32]
    context_dense: NDArray[np.float32]
    labels: NDArray[np.float32] | None = None
    has_context: bool = False
    schema_hash: int = 0

    @classmethod
    def from_slots(
        cls,
        num_rows: int,
        slots: list[SlotView],
        dense: ArrayLike,
        context_dense: ArrayLike | None = None,
        labels: ArrayLike | None = None,
        has_context: bool = False,
        schema_hash: int = 0,
    ) -> CompactBatch:
        sign_counts = np.array([len(s.signs) for s in slots], dtype=np.uint32)
        vdt = index_dtype(int(sign_counts.max(initial=0)))
        empty_u64 = np.empty(0, np.uint64)
        return cls(
            num_rows=int(num_rows),
            flags=np.array(
                [FLAG_CONTEXT * s.context | FLAG_MULTI * (s.offsets is not None) for s in slots], np.uint8
            ),
            sign_counts=sign_counts,
            value_counts=np.array([len(s.values) for s in slots], dtype=np.uint32),
            signs=np.concatenate([s.signs for s in slots]).astype(np.uint64) if slots else empty_u64,
            values=np.concatenate([s.values for s in slots]).astype(vdt) if slots else np.empty(0, vdt),
            offsets=np.concatenate(
                [s.offsets for s in slots if s.offsets is not None] + [np.empty(0, np.uint32)]
            ).astype(np.uint32),
            dense=_as_matrix(dense, num_rows),
            context_dense=np.zeros(0, np.float32)
            if context_dense is None
            else np.ascontiguousarray(context_dense, np.float32).reshape(-1),
            labels=None if labels is None else np.ascontiguousarray(labels, np.float32).reshape(num_rows),
            has_context=bool(has_context),
            schema_hash=int(schema_hash),
        )

    # --- derived -------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self.flags)

    @property
    def sign_splits(self) -> NDArray[np.int64]:
        return np.concatenate(([0], np.cumsum(self.sign_counts, dtype=np.int64)))

    @property
    def value_splits(self) -> NDArray[np.int64]:
        return np.concatenate(([0], np.cumsum(self.value_counts, dtype=np.int64)))

    def rows_of(self, slot: int) -> int:
        return 1 if self.flags[slot] & FLAG_CONTEXT else self.num_rows

    def slot(self, i: int) -> SlotView:
        """The arrays of slot ``i`` (views, no copies)."""
        ss, vs = self.sign_splits, self.value_splits
        offsets = None
        if self.flags[i] & FLAG_MULTI:
            start = sum(self.rows_of(j) + 1 for j in range(i) if self.flags[j] & FLAG_MULTI)
            offsets = self.offsets[start : start + self.rows_of(i) + 1]
        return SlotView(
            self.signs[ss[i] : ss[i + 1]],
            self.values[vs[i] : vs[i + 1]],
            offsets,
            bool(self.flags[i] & FLAG_CONTEXT),
        )

    def global_values(self) -> NDArray[np.int64]:
        """Per value, its index into the whole ``signs`` array (int64)."""
        starts = self.sign_splits[:-1]
        return self.values.astype(np.int64) + np.repeat(starts, self.value_counts.astype(np.int64))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CompactBatch):
            return NotImplemented
        same = (
            self.num_rows == other.num_rows
            and self.has_context == other.has_context
            and self.schema_hash == other.schema_hash
            and (self.labels is None) == (other.labels is None)
            and self.values.dtype == other.values.dtype
        )
        arrays = (
            "flags",
            "sign_counts",
            "value_counts",
            "signs",
            "values",
            "offsets",
            "dense",
            "context_dense",
        )
        same = same and all(np.array_equal(getattr(self, a), getattr(other, a)) for a in arrays)
        same = same and self.dense.shape == other.dense.shape
        return bool(
            same
            and (
                self.labels is None or other.labels is not None and np.array_equal(self.labels, other.labels)
            )
        )

    # __hash__ stays None (a class that defines __eq__ gets none): mutable arrays inside
