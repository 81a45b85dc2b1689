"""``transform(records, schema) -> CompactBatch``: the one feature pipeline, offline and online.

Accepted inputs (all go through the same column code below):

- a ``Table`` (columns of strings from the file readers in ``features.readers``);
- a list of flat records ``[{"C1": "05db9164", "I1": 3, ...}, ...]`` (one per row);
- a ranking request ``{"context": {...}, "items": [{...}, ...]}``: context-scoped features once,
  item-scoped features per item. Such a batch stores its context slots once;
- the same request in column form, ``{"context": {...}, "items": {"C1": [v, ...], "I1": [...]}}``:
  each item field's values as one array (missing: absent, or null). orjson parses it straight into
  the columns this code works on, with no pass over the items in Python: the fast form for clients.

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

import numpy as np

from features.batch import FLAG_CONTEXT, FLAG_MULTI, CompactBatch, index_dtype
from features.hashing import SIGN_BITS, cross_signs, hash_str_list, hash_values
from features.schema import Cross, Schema, Slot


class FeatureError(ValueError):
    """Records that do not fit the schema; the message names the field and the problem."""


@dataclass
class Table:
    """Columns of equal length (numpy arrays), e.g. from a file reader. Missing values are ""."""

    columns: dict[str, np.ndarray]
    num_rows: int


_NONE = type(None)


# --- input normalisation ------------------------------------------------------------------------
@dataclass
class _Input:
    num_rows: int
    has_context: bool
    items: list | dict | Table  # per-row records, columns (name -> values), or a Table
    context: dict | None  # request context (one record) or None

    def stored_once(self, scope: str) -> bool:
        return scope == "context" and self.has_context

    def columns(self, slots: list[Slot], once: bool, missing) -> list:
        """One list/array per slot: its values for every stored row (1 row if ``once``)."""
        if once:
            return [[self.context.get(s.column, missing)] for s in slots]
        if isinstance(self.items, Table):
            blank = np.full(self.num_rows, "", np.str_)
            return [self.items.columns.get(s.column, blank) for s in slots]
        if isinstance(self.items, dict):  # the column form: each column's values as sent
            absent = [missing] * self.num_rows
            return [self.items.get(s.column, absent) for s in slots]
        # map(dict.get, ...) runs the loop in C: ~3x faster than a comprehension
        return [
            list(map(dict.get, self.items, itertools.repeat(s.column), itertools.repeat(missing)))
            for s in slots
        ]


def _normalise(records, schema: Schema) -> _Input:
    if isinstance(records, Table):
        return _Input(records.num_rows, False, records, None)
    if isinstance(records, Mapping):
        if set(records) - {"context", "items"} or "items" not in records:
            raise FeatureError('a request is {"context": {...}, "items": [{...}, ...]} or a list of records')
        items, context = records["items"], records.get("context", {})
        context = {} if context is None else context
        if not isinstance(context, dict):
            raise FeatureError('"context" must be an object')
        if isinstance(items, dict):  # the column form: {"C1": [v, ...], "I1": [...], ...}
            n = _check_columns(items, schema)
            _check_fields([context], schema, "context", allow_label=False)
            return _Input(n, True, items, context)
        if not isinstance(items, list) or not items:
            raise FeatureError(
                '"items" must be a non-empty list of objects, or an object of equal-length arrays'
            )
        _check_fields(items, schema, "item", allow_label=False)
        _check_fields([context], schema, "context", allow_label=False)
        return _Input(len(items), True, items, context)
    if isinstance(records, list):
        if not records:
            raise FeatureError("no records")
        _check_fields(records, schema, None, allow_label=True)
        return _Input(len(records), False, records, None)
    raise FeatureError(
        f"records must be a request object, a list of records or a Table, not {type(records).__name__}"
    )


def _check_columns(items: dict, schema: Schema) -> int:
    """The item count of a column-form request, after checking it: known item fields only, each an
    array, all of one non-zero length, required ones present with no missing value."""
    allowed = {s.column for s in schema.slots if s.scope == "item"}
    unknown = set(items) - allowed
    if unknown:
        hint = (
            " (sent in the wrong part of the request)" if {s.column for s in schema.slots} & unknown else ""
        )
        raise FeatureError(f"unknown field(s) in items: {sorted(map(str, unknown))[:5]}{hint}")
    if not items:
        raise FeatureError('"items" has no columns')
    lengths = {len(v) if isinstance(v, list) else -1 for v in items.values()}
    if -1 in lengths:
        bad = next(k for k, v in items.items() if not isinstance(v, list))
        raise FeatureError(f"items column {bad!r} must be an array (one value per item)")
    if len(lengths) != 1 or 0 in lengths:
        raise FeatureError(
            f"items columns must all have the same non-zero length, got lengths {sorted(lengths)}"
        )
    for s in schema.slots:
        if s.required and s.scope == "item":
            col = items.get(s.column)
            if col is None or None in col or "" in col:
                raise FeatureError(f"required field {s.column!r} is missing")
    return lengths.pop()


def _check_fields(records: list, schema: Schema, scope: str | None, allow_label: bool) -> None:
    if not all(isinstance(r, dict) for r in records):
        raise FeatureError("every record/item must be a JSON object")
    allowed = {s.column for s in schema.slots if scope is None or s.scope == scope}
    if allow_label and schema.label:
        allowed.add(schema.label)
    unknown = set().union(*records) - allowed
    if unknown:
        where = f" in {scope}" if scope else ""
        hint = (
            " (sent in the wrong part of the request)" if {s.column for s in schema.slots} & unknown else ""
        )
        raise FeatureError(f"unknown field(s){where}: {sorted(map(str, unknown))[:5]}{hint}")
    for s in schema.slots:
        if s.required and (scope is None or s.scope == scope):
            col = list(map(dict.get, records, itertools.repeat(s.column)))
            if None in col or "" in col:
                raise FeatureError(f"required field {s.column!r} is missing")


# --- column groups -> arrays --------------------------------------------------------------------
def _strings(cols: list, slots: list[Slot]) -> np.ndarray:
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


def _hash_group(cols: list, slots: list[Slot], ids: np.ndarray) -> np.ndarray:
    """Signs of k categorical columns (flattened, column after column)."""
    if not isinstance(cols[0], np.ndarray):
        flat = list(itertools.chain.from_iterable(cols))
        try:
            return hash_str_list(flat, ids)  # fast path: every value a str
        except ValueError:
            pass
    return hash_values(_strings(cols, slots).reshape(-1), ids)


def _numbers(cols: list, slots: list[Slot]) -> np.ndarray:
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


def _first_bad(cols: list, slots: list[Slot]) -> str:
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


def _multi(vals, slot: Slot) -> tuple[np.ndarray, np.ndarray]:
    """Flat values and per-row lengths of a multi-valued column (lists or separator-joined)."""
    if isinstance(vals, np.ndarray):
        vals = vals.tolist()
    types = set(map(type, vals))
    if types <= {str, _NONE}:
        arr = np.array(vals, dtype=object)
        arr[arr == None] = ""  # noqa: E711
        nonempty = arr != ""
        lengths = np.zeros(len(arr), np.int64)
        flat: list = []
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
    position: dict  # sparse feature name -> batch slot index
    lo: np.ndarray
    hi: np.ndarray
    log1p: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    default: np.ndarray


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


def _dense(inp: _Input, plan: _Plan, once: bool) -> np.ndarray:
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
def transform(records, schema: Schema) -> CompactBatch:
    """Records (Table, list of records or a ranking request) -> CompactBatch."""
    inp = _normalise(records, schema)
    plan = _plan(schema)
    n_sparse = len(plan.position)
    per_slot: list[np.ndarray | None] = [None] * n_sparse  # signs per stored value
    offsets: list[np.ndarray | None] = [None] * n_sparse
    once = np.zeros(n_sparse, dtype=bool)
    row_signs: dict[str, np.ndarray] = {}  # single-valued signs by name, for crosses

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

    signs, values, sign_counts, value_counts = _dedup(per_slot, schema)
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


def _dedup(per_slot: list[np.ndarray], schema: Schema):
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


def _labels(inp: _Input, schema: Schema) -> np.ndarray | None:
    if inp.has_context or not schema.label:
        return None
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


def dense_matrix(batch: CompactBatch, schema: Schema) -> np.ndarray:
    """All dense features per row, in schema order (context values broadcast)."""
    if not batch.has_context:
        return batch.dense
    out = np.empty((batch.num_rows, len(schema.dense)), np.float32)
    is_ctx = np.array([s.scope == "context" for s in schema.dense], dtype=bool)
    out[:, ~is_ctx] = batch.dense
    out[:, is_ctx] = batch.context_dense
    return out
