"""``transform(records, schema) -> CompactBatch``: the one feature pipeline, offline and online.

Records come as a ``Table``, a list of records or a ranking request (row or column form); all are
checked and seen as one ``Input`` (``features.inputs``), so they go through the same column code
below. A request's batch stores its context slots once.

Work is per group of columns: the columns are pulled out of the records with C-level ``map``,
converted to one 2-D numpy array, hashed in one compiled call, deduplicated with one ``np.unique``
for all slots at once (signs carry the slot id in their top bits), and dense columns are parsed
and transformed as one matrix. There is no Python loop per value or per row.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from features.batch import FLAG_CONTEXT, FLAG_MULTI, CompactBatch, index_dtype
from features.hashing import SIGN_BITS, cross_signs, hash_str_list, hash_values
from features.inputs import Column, FeatureError, Input, Record, Table, normalise
from features.schema import Cross, Schema, Slot

__all__ = ["FeatureError", "Records", "Table", "dense_matrix", "transform"]

Records = Table | list[Record] | Mapping[str, Any]
"""A Table, a list of records, or a ranking request (``features.inputs`` says what each holds)."""

_NONE = type(None)


# --- column groups -> arrays --------------------------------------------------------------------
def _strings(cols: list[Column], slots: list[Slot]) -> NDArray[np.str_]:
    """(k, m) unicode array of k categorical columns; missing (None) becomes ""."""
    try:
        arr = np.array(cols)
    except ValueError:
        raise FeatureError("records have inconsistent columns") from None
    if arr.dtype.kind == "U" and arr.ndim == 2:
        return arr
    if arr.ndim != 2:  # lists where single values belong
        arr = np.empty((len(cols), len(cols[0])), dtype=object)
        arr[:] = [list(c) for c in cols]
    flat = arr.reshape(-1)
    bad = set(map(type, flat)) - {str, int, _NONE}
    if bad:
        col = next(s.column for s, c in zip(slots, cols, strict=True) if set(map(type, c)) & bad)
        raise FeatureError(
            f"field {col!r}: expected a string or integer, got {sorted(t.__name__ for t in bad)}"
        )
    flat[flat == None] = ""  # noqa: E711 (element-wise comparison)
    return flat.astype(np.str_).reshape(arr.shape)


def _hash_group(cols: list[Column], slots: list[Slot], ids: NDArray[np.int64]) -> NDArray[np.uint64]:
    """Signs of k categorical columns (flattened, column after column)."""
    if not isinstance(cols[0], np.ndarray):
        flat = list(itertools.chain.from_iterable(cols))
        try:
            return hash_str_list(flat, ids)  # fast path: every value a str
        except ValueError:
            pass
    return hash_values(_strings(cols, slots).reshape(-1), ids)


def _numbers(cols: list[Column], slots: list[Slot]) -> NDArray[np.float64]:
    """(k, m) float64 array of k dense columns, NaN where missing (None or "")."""
    if cols and isinstance(cols[0], np.ndarray) and cols[0].dtype.kind == "U":  # a Table
        arr = np.array(cols)
        out = np.full(arr.shape, np.nan)
        present = arr != ""
        try:
            out[present] = arr[present].astype(np.float64)
        except ValueError:
            raise FeatureError(f"{_first_bad(cols, slots)}: not a number") from None
        return out
    try:
        out = np.array(cols, dtype=np.float64)  # None -> nan
    except (ValueError, TypeError):
        raise FeatureError(f"{_first_bad(cols, slots)}: expected a number") from None
    if out.ndim != 2:  # a list or object where a number belongs
        raise FeatureError(f"{_first_bad(cols, slots)}: expected a number")
    if not np.isfinite(out[~np.isnan(out)]).all():
        raise FeatureError(f"{_first_bad(cols, slots)}: value is not finite")
    return out


def _first_bad(cols: list[Column], slots: list[Slot]) -> str:
    """Error path only: name the first field whose values are not numbers."""
    for s, c in zip(slots, cols, strict=True):
        for v in c:
            if v is None or v == "" or type(v) in (int, float) and np.isfinite(v):
                continue
            try:
                if isinstance(v, str) and np.isfinite(float(v)):
                    continue
            except ValueError:
                pass
            return f"field {s.column!r} value {str(v)[:40]!r}"
    return "a dense field"


def _multi(vals: Column, slot: Slot) -> tuple[NDArray[np.str_], NDArray[np.int64]]:
    """Flat values and per-row lengths of a multi-valued column (lists or separator-joined)."""
    if isinstance(vals, np.ndarray):
        vals = vals.tolist()
    types = set(map(type, vals))
    if types <= {str, _NONE}:
        arr = np.array(vals, dtype=object)
        arr[arr == None] = ""  # noqa: E711
        nonempty = arr != ""
        lengths = np.zeros(len(arr), np.int64)
        flat: list[str] = []
        if nonempty.any():
            joined = arr[nonempty].astype(np.str_)
            lengths[nonempty] = np.char.count(joined, slot.separator) + 1
            flat = slot.separator.join(joined.tolist()).split(slot.separator)
        return np.array(flat, dtype=np.str_), lengths
    if types <= {list, _NONE}:
        vals = [v or [] for v in vals] if _NONE in types else vals
        flat = list(itertools.chain.from_iterable(vals))
        if not set(map(type, flat)) <= {str, int}:
            raise FeatureError(f"field {slot.column!r}: list elements must be strings or integers")
        return np.array(flat, dtype=np.str_), np.fromiter(map(len, vals), np.int64, len(vals))
    raise FeatureError(f"field {slot.column!r}: expected a list or a {slot.separator!r}-joined string")


# --- the plan: per-schema constants, computed once ------------------------------------------------
@dataclass(frozen=True)
class _Plan:
    single: tuple[Slot, ...]
    multi: tuple[Slot, ...]
    crosses: tuple[Cross, ...]
    dense: tuple[Slot, ...]
    position: dict[str, int]  # sparse feature name -> batch slot index
    lo: NDArray[np.float64]
    hi: NDArray[np.float64]
    log1p: NDArray[np.bool_]
    mean: NDArray[np.float64]
    std: NDArray[np.float64]
    default: NDArray[np.float64]


@functools.lru_cache(maxsize=64)
def _plan(schema: Schema) -> _Plan:
    dense = schema.dense
    t = [s.transform for s in dense]
    return _Plan(
        single=tuple(s for s in schema.slots if s.kind == "categorical"),
        multi=tuple(s for s in schema.slots if s.kind == "multi"),
        crosses=schema.crosses,
        dense=dense,
        position={f.name: i for i, f in enumerate(schema.sparse)},
        lo=np.array([-np.inf if x.clip_min is None else x.clip_min for x in t]),
        hi=np.array([np.inf if x.clip_max is None else x.clip_max for x in t]),
        log1p=np.array([x.log1p for x in t], dtype=bool),
        mean=np.array([0.0 if x.mean is None else x.mean for x in t]),
        std=np.array([1.0 if x.std is None else x.std for x in t]),
        default=np.array([x.default for x in t]),
    )


def _dense(inp: Input, plan: _Plan, once: bool) -> NDArray[np.float32]:
    """Transformed float32 (rows, k) matrix of the dense slots stored once / per row."""
    sel = np.array([inp.stored_once(s.scope) == once for s in plan.dense], dtype=bool)
    slots = [s for s, keep in zip(plan.dense, sel, strict=True) if keep]
    rows = 1 if once else inp.num_rows
    if not slots:
        return np.zeros((rows, 0), np.float32)
    raw = _numbers(inp.columns(slots, once, None), slots)  # (k, rows)
    k = np.arange(len(slots))
    default, lo, hi = plan.default[sel], plan.lo[sel], plan.hi[sel]
    raw = np.where(np.isnan(raw), default[:, None], raw)
    raw = np.clip(raw, lo[:, None], hi[:, None])
    logged = plan.log1p[sel]
    if logged.any():
        part = raw[logged]
        if (part <= -1).any():
            bad = slots[int(k[logged][np.nonzero((part <= -1).any(axis=1))[0][0]])]
            raise FeatureError(f"field {bad.column!r}: log1p of a value <= -1 (add clip_min to the schema)")
        raw[logged] = np.log1p(part)
    raw = (raw - plan.mean[sel][:, None]) / plan.std[sel][:, None]
    return np.ascontiguousarray(raw.T, dtype=np.float32)


# --- the pipeline --------------------------------------------------------------------------------
def transform(records: Records, schema: Schema) -> CompactBatch:
    """Records (Table, list of records or a ranking request) -> CompactBatch."""
    inp = normalise(records, schema)
    plan = _plan(schema)
    n_sparse = len(plan.position)
    per_slot: dict[int, NDArray[np.uint64]] = {}  # batch slot -> signs per stored value
    offsets: list[NDArray[np.uint32] | None] = [None] * n_sparse
    once = np.zeros(n_sparse, dtype=bool)
    row_signs: dict[str, NDArray[np.uint64]] = {}  # single-valued signs by name, for crosses

    for stored_once in (False, True):
        group = [s for s in plan.single if inp.stored_once(s.scope) == stored_once]
        if not group:
            continue
        cols = inp.columns(group, stored_once, "")
        m = 1 if stored_once else inp.num_rows
        ids = np.repeat(np.array([s.id for s in group], dtype=np.int64), m)
        signs = _hash_group(cols, group, ids).reshape(len(group), m)
        for s, row in zip(group, signs, strict=True):
            per_slot[plan.position[s.name]] = row
            once[plan.position[s.name]] = stored_once
            row_signs[s.name] = row
    for s in plan.multi:
        stored_once = inp.stored_once(s.scope)
        flat, lengths = _multi(inp.columns([s], stored_once, None)[0], s)
        i = plan.position[s.name]
        per_slot[i] = hash_values(flat, s.id)
        offsets[i] = np.concatenate(([0], np.cumsum(lengths))).astype(np.uint32)
        once[i] = stored_once
    for c in plan.crosses:
        a, b = (row_signs[x] for x in c.slots)
        n = max(len(a), len(b))
        i = plan.position[c.name]
        per_slot[i] = cross_signs(np.broadcast_to(a, n), np.broadcast_to(b, n), c.id)
        once[i] = inp.stored_once(schema.scope_of(c))

    signs, values, sign_counts, value_counts = _dedup([per_slot[i] for i in range(n_sparse)], schema)
    return CompactBatch(
        num_rows=inp.num_rows,
        flags=(once * FLAG_CONTEXT | np.array([o is not None for o in offsets], bool) * FLAG_MULTI).astype(
            np.uint8
        ),
        sign_counts=sign_counts,
        value_counts=value_counts,
        signs=signs,
        values=values,
        offsets=np.concatenate([o for o in offsets if o is not None] + [np.empty(0, np.uint32)]),
        dense=_dense(inp, plan, once=False),
        context_dense=_dense(inp, plan, once=True).reshape(-1)
        if inp.has_context
        else np.zeros(0, np.float32),
        labels=_labels(inp, schema),
        has_context=inp.has_context,
        schema_hash=schema.hash64,
    )


def _dedup(
    per_slot: list[NDArray[np.uint64]], schema: Schema
) -> tuple[NDArray[np.uint64], NDArray[np.unsignedinteger[Any]], NDArray[np.uint32], NDArray[np.uint32]]:
    """One np.unique for all slots: signs sorted within each slot, slots in schema order."""
    value_counts = np.array([len(v) for v in per_slot], dtype=np.uint32)
    all_signs = np.concatenate(per_slot) if per_slot else np.empty(0, np.uint64)
    uniq, inverse = np.unique(all_signs, return_inverse=True)
    slot_ids = np.array([f.id for f in schema.sparse], dtype=np.int64)
    rank = np.zeros(int(slot_ids.max(initial=0)) + 1, np.int64)
    rank[slot_ids] = np.arange(len(slot_ids))
    slot_of_uniq = rank[(uniq >> np.uint64(SIGN_BITS)).astype(np.int64)]
    if len(slot_of_uniq) > 1 and (np.diff(slot_of_uniq) < 0).any():  # ids not ascending in schema order
        perm = np.argsort(slot_of_uniq, kind="stable")
        uniq, slot_of_uniq = uniq[perm], slot_of_uniq[perm]
        inverse = np.argsort(perm)[inverse]
    sign_counts = np.bincount(slot_of_uniq, minlength=len(per_slot)).astype(np.uint32)
    starts = np.cumsum(sign_counts, dtype=np.int64) - sign_counts
    local = inverse.reshape(-1) - np.repeat(starts, value_counts.astype(np.int64))
    return uniq, local.astype(index_dtype(int(sign_counts.max(initial=0)))), sign_counts, value_counts


def _labels(inp: Input, schema: Schema) -> NDArray[np.float32] | None:
    if inp.has_context or not schema.label or isinstance(inp.items, dict):  # a dict: a request's columns
        return None
    col: Column | None
    if isinstance(inp.items, Table):
        col = inp.items.columns.get(schema.label)
        if col is None:
            return None
    else:
        col = list(map(dict.get, inp.items, itertools.repeat(schema.label)))
        if set(col) == {None}:
            return None
    try:
        labels = np.asarray(col).astype(np.float32)
    except (ValueError, TypeError):
        raise FeatureError(f"label {schema.label!r}: every record needs a numeric label") from None
    if not np.isfinite(labels).all():
        raise FeatureError(f"label {schema.label!r}: not finite")
    return labels


def dense_matrix(batch: CompactBatch, schema: Schema) -> NDArray[np.float32]:
    """All dense features per row, in schema order (context values broadcast)."""
    if not batch.has_context:
        return batch.dense
    out = np.empty((batch.num_rows, len(schema.dense)), np.float32)
    is_ctx = np.array([s.scope == "context" for s in schema.dense], dtype=bool)
    out[:, ~is_ctx] = batch.dense
    out[:, is_ctx] = batch.context_dense
    return out
