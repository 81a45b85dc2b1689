"""``transform(records, schema) -> CompactBatch``: the one feature pipeline, offline and online.

Records come as a ``Table``, a list of records or a ranking request (row or column form); all are
checked and seen as one ``Input`` (``features.inputs``), so they go through the same column code
below. A request's batch stores its context slots once.

Work is per group of columns: the columns are pulled out of the records with C-level ``map``,
converted to one 2-D numpy array (``features.columns``), hashed in one compiled call, deduplicated with one ``np.unique``
for all slots at once (signs carry the slot id in their top bits), and dense columns are parsed
and transformed as one matrix. There is no Python loop per value or per row.

``from_json`` is the scoring path's way in for JSON: a list of records or a ranking request (rows
or columns) is read from its bytes by one compiled pass (``features.jsonscan``: signs and dense
values, no Python object per value) and joins the pipeline below at the same point; any other body
is ``transform(orjson.loads(body))``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
from numpy.typing import NDArray

from features.batch import FLAG_CONTEXT, FLAG_MULTI, CompactBatch, index_dtype
from features.columns import first_bad, hash_group, multi_values, numbers
from features.hashing import SIGN_MASK, SLOT_SHIFT, cross_signs, hash_values
from features.inputs import Column, FeatureError, Input, Record, Scanned, Table, check_context, normalise
from features.schema import Cross, Schema, Slot

if TYPE_CHECKING:
    from features.jsonscan import ScanTable

__all__ = ["FeatureError", "Records", "Table", "dedup_spans", "dense_matrix", "from_json", "transform"]

Records = Table | list[Record] | Mapping[str, Any]
"""A Table, a list of records, or a ranking request (``features.inputs`` says what each holds)."""


# --- the plan: per-schema constants, computed once ------------------------------------------------
@dataclass(frozen=True)
class _Dense:
    """The dense slots stored per row, or once (a request's context), and their transform."""

    slots: tuple[Slot, ...]
    lo: NDArray[np.float64]
    hi: NDArray[np.float64]
    log1p: NDArray[np.bool_]
    mean: NDArray[np.float64]
    std: NDArray[np.float64]
    default: NDArray[np.float64]

    @classmethod
    def of(cls, slots: list[Slot]) -> _Dense:
        t = [s.transform for s in slots]
        return cls(
            slots=tuple(slots),
            lo=np.array([-np.inf if x.clip_min is None else x.clip_min for x in t], np.float64),
            hi=np.array([np.inf if x.clip_max is None else x.clip_max for x in t], np.float64),
            log1p=np.array([x.log1p for x in t], dtype=bool),
            mean=np.array([0.0 if x.mean is None else x.mean for x in t], np.float64),
            std=np.array([1.0 if x.std is None else x.std for x in t], np.float64),
            default=np.array([x.default for x in t], np.float64),
        )


@dataclass(frozen=True)
class _Layout:
    """Which slots a batch stores per row and which once: rows with a context (a ranking
    request) store context-scoped slots once; plain rows store every slot per row."""

    single: tuple[tuple[Slot, ...], tuple[Slot, ...]]  # categorical slots (per row, once)
    single_at: tuple[NDArray[np.int64], NDArray[np.int64]]  # their batch slot indices
    single_ids: tuple[list[int], list[int]]  # their slot ids
    dense: tuple[_Dense, _Dense]  # (per row, once)
    scan: ScanTable | None  # the per-row fields a JSON body's compiled scan fills (None: not scanned)


@dataclass(frozen=True)
class _Plan:
    multi: tuple[Slot, ...]
    crosses: tuple[Cross, ...]
    position: dict[str, int]  # sparse feature name -> batch slot index
    slot_ids: NDArray[np.uint64]  # batch slot index -> slot id
    rank: NDArray[np.int64]  # slot id -> batch slot index
    ids_ascending: bool  # batch slots in ascending slot id: sorted signs are in batch slot order
    layouts: tuple[_Layout, _Layout]  # (plain rows, a request with a context)


def _layout(schema: Schema, position: dict[str, int], has_context: bool) -> _Layout:
    def once(s: Slot) -> bool:
        return has_context and s.scope == "context"

    from features.jsonscan import ScanTable

    single = [s for s in schema.slots if s.kind == "categorical"]
    groups = tuple(tuple(s for s in single if once(s) == o) for o in (False, True))
    dense = (
        _Dense.of([s for s in schema.dense if not once(s)]),
        _Dense.of([s for s in schema.dense if once(s)]),
    )
    scanned = not any(s.kind == "multi" and not once(s) for s in schema.slots)
    return _Layout(
        single=(groups[0], groups[1]),
        single_at=(
            np.array([position[s.name] for s in groups[0]], np.int64),
            np.array([position[s.name] for s in groups[1]], np.int64),
        ),
        single_ids=([s.id for s in groups[0]], [s.id for s in groups[1]]),
        dense=dense,
        scan=ScanTable.of(groups[0], dense[0].slots) if scanned else None,
    )


_PLANS: dict[int, tuple[Schema, _Plan]] = {}


def _plan(schema: Schema) -> _Plan:
    """The schema's plan, built on first use and kept by identity (hashing a Schema hashes every
    slot: longer than the lookup it would save)."""
    hit = _PLANS.get(id(schema))
    if hit is not None and hit[0] is schema:
        return hit[1]
    position = {f.name: i for i, f in enumerate(schema.sparse)}
    slot_ids = np.array([f.id for f in schema.sparse], dtype=np.int64)
    rank = np.zeros(int(slot_ids.max(initial=0)) + 1, np.int64)
    rank[slot_ids] = np.arange(len(slot_ids))
    plan = _Plan(
        multi=tuple(s for s in schema.slots if s.kind == "multi"),
        crosses=schema.crosses,
        position=position,
        slot_ids=slot_ids.astype(np.uint64),
        rank=rank,
        ids_ascending=bool((np.diff(slot_ids) > 0).all()),
        layouts=(_layout(schema, position, False), _layout(schema, position, True)),
    )
    if len(_PLANS) >= 64:
        _PLANS.clear()
    _PLANS[id(schema)] = (schema, plan)
    return plan


def _dense(inp: Input, d: _Dense, once: bool) -> NDArray[np.float32]:
    """Transformed float32 (rows, k) matrix of the dense slots ``d`` (stored once / per row)."""
    rows = 1 if once else inp.num_rows
    if not d.slots:
        return np.zeros((rows, 0), np.float32)
    from features.kernels import LOG1P_DOMAIN, dense_columns

    cols: list[Column] | None = None  # None: the scan's values, already numbers
    if not once and isinstance(inp.items, Scanned):
        raw = inp.items.values
    else:
        cols = inp.columns(list(d.slots), once, None)
        raw = numbers(cols, d.slots)
    out, bad, why = dense_columns(raw, d.default, d.lo, d.hi, d.log1p, d.mean, d.std)
    if why == LOG1P_DOMAIN:
        raise FeatureError(
            f"field {d.slots[bad].column!r}: log1p of a value <= -1 (add clip_min to the schema)"
        )
    if why:  # a raw value that is not finite (named), or one whose feature is beyond float32
        where = None if cols is None else first_bad(cols, d.slots)
        if where is None:
            raise FeatureError(f"field {d.slots[bad].column!r}: a value beyond float32 once transformed")
        raise FeatureError(f"{where}: value is not finite")
    return out


# --- the pipeline --------------------------------------------------------------------------------
def transform(records: Records, schema: Schema) -> CompactBatch:
    """Records (Table, list of records or a ranking request) -> CompactBatch."""
    return _batch(normalise(records, schema), schema)


def from_json(body: bytes, schema: Schema, max_rows: int = 1 << 62) -> CompactBatch | None:
    """The batch of a list of records or a ranking request (rows or columns) read straight from
    its bytes (``features.jsonscan``), equal to ``transform(orjson.loads(body), schema)``; None for
    a body outside the scan's form, of more than ``max_rows`` items, or one that is a mistake: the
    caller then parses it, and orjson, its limit and ``transform`` name the error."""
    from features.jsonscan import scan, scan_records

    layouts = _plan(schema).layouts
    if body[:1] == b"[" or (body[:1].isspace() and body.lstrip()[:1] == b"["):  # a list of records
        table = layouts[False].scan
        records = None if table is None else scan_records(body, table, max_rows)
        try:
            return None if records is None else _batch(Input(records.num_rows, False, records), schema)
        except FeatureError:  # a value transform refuses: its parse names it
            return None
    table = layouts[True].scan
    scanned = None if table is None else scan(body, table, max_rows)
    if scanned is None:
        return None
    items, context_json = scanned
    try:
        context = None if context_json is None else orjson.loads(context_json)
        context = check_context(context, schema)
        return _batch(Input(items.num_rows, True, items, context), schema)
    except (orjson.JSONDecodeError, FeatureError):
        return None


def _batch(inp: Input, schema: Schema) -> CompactBatch:
    plan = _plan(schema)
    layout = plan.layouts[inp.has_context]
    n_sparse = len(plan.position)
    per_slot: list[NDArray[np.uint64]] = [np.empty(0, np.uint64)] * n_sparse  # signs per stored value
    offsets: list[NDArray[np.uint32] | None] = [None] * n_sparse
    once = np.zeros(n_sparse, dtype=bool)
    row_signs: dict[str, NDArray[np.uint64]] = {}  # single-valued signs by name, for crosses

    for stored_once in (False, True):
        group = layout.single[stored_once]
        if not group:
            continue
        m = 1 if stored_once else inp.num_rows
        if isinstance(inp.items, Scanned) and not stored_once:
            signs = inp.items.signs
        else:
            cols = inp.columns(list(group), stored_once, "")
            signs = hash_group(cols, list(group), layout.single_ids[stored_once]).reshape(len(group), m)
        once[layout.single_at[stored_once]] = stored_once
        for i, row in zip(layout.single_at[stored_once].tolist(), signs, strict=True):
            per_slot[i] = row
        if plan.crosses:
            row_signs.update(zip((s.name for s in group), signs, strict=True))
    for s in plan.multi:
        stored_once = inp.stored_once(s.scope)
        flat, lengths = multi_values(inp.columns([s], stored_once, None)[0], s)
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

    signs, values, sign_counts, value_counts = _dedup(per_slot, plan)
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
        dense=_dense(inp, layout.dense[0], once=False),
        context_dense=_dense(inp, layout.dense[1], once=True).reshape(-1)
        if inp.has_context
        else np.zeros(0, np.float32),
        labels=_labels(inp, schema),
        has_context=inp.has_context,
        schema_hash=schema.hash64,
    )


def _dedup(
    per_slot: list[NDArray[np.uint64]], plan: _Plan
) -> tuple[NDArray[np.uint64], NDArray[np.unsignedinteger[Any]], NDArray[np.uint32], NDArray[np.uint32]]:
    """One compiled dedup for all slots: signs sorted within each slot, slots in schema order."""
    value_counts = np.fromiter(map(len, per_slot), np.int64, len(per_slot))
    all_signs = np.concatenate(per_slot) if per_slot else np.empty(0, np.uint64)
    return _dedup_all(all_signs, value_counts, plan)


def dedup_spans(
    signs: NDArray[np.uint64],
    starts: NDArray[np.int64],
    lengths: NDArray[np.int64],
    bounds: NDArray[np.int64],
    schema: Schema,
) -> tuple[NDArray[np.uint64], NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
    """A compact batch's sparse part for each span of decoded samples' rows, by the same compiled
    dedup as ``transform``'s (``features.kernels.dedup_spans``; ``stream.sample_batch.to_batches``: row
    r's signs are ``signs[starts[r]:starts[r + 1]]``, ``lengths[r, j]`` in slot j; the spans are
    rows ``bounds[i]`` to ``bounds[i + 1]``), in one compiled call for all of them: (the spans'
    distinct signs, each value's local index, per span and slot the sign and the value counts)."""
    from features.kernels import dedup_spans as spans

    plan = _plan(schema)
    if plan.ids_ascending:
        return spans(starts, signs, lengths, np.asarray(bounds, np.int64), plan.rank)
    ranks = np.arange(lengths.shape[1], dtype=np.int64)
    uniq, local, sign_counts, value_counts = spans(starts, _by_rank(signs, plan), lengths, np.asarray(bounds, np.int64), ranks)  # fmt: skip
    return _from_rank(uniq, plan), local, sign_counts, value_counts


def _by_rank(signs: NDArray[np.uint64], plan: _Plan) -> NDArray[np.uint64]:
    """The signs with their slot's batch rank in the top bits instead of its id: sorted, they
    are in batch slot order (slot ids that do not ascend with the slots)."""
    ranks = plan.rank[(signs >> SLOT_SHIFT).astype(np.int64)].astype(np.uint64)
    return np.asarray((ranks << SLOT_SHIFT) | (signs & SIGN_MASK), np.uint64)


def _from_rank(keys: NDArray[np.uint64], plan: _Plan) -> NDArray[np.uint64]:
    """``_by_rank``'s inverse."""
    return np.asarray((plan.slot_ids[(keys >> SLOT_SHIFT).astype(np.int64)] << SLOT_SHIFT) | (keys & SIGN_MASK), np.uint64)  # fmt: skip


def _dedup_all(
    all_signs: NDArray[np.uint64], value_counts: NDArray[np.int64], plan: _Plan
) -> tuple[NDArray[np.uint64], NDArray[np.unsignedinteger[Any]], NDArray[np.uint32], NDArray[np.uint32]]:
    from features.kernels import dedup_slots

    if plan.ids_ascending:
        uniq, local, sign_counts = dedup_slots(all_signs, value_counts, plan.rank)
    else:  # sort by batch slot, then sign: the slot's rank in the top bits while deduplicating
        ranks = np.arange(len(value_counts), dtype=np.int64)
        uniq, local, sign_counts = dedup_slots(_by_rank(all_signs, plan), value_counts, ranks)
        uniq = _from_rank(uniq, plan)
    index = local.astype(index_dtype(int(sign_counts.max(initial=0))))
    return uniq, index, sign_counts.astype(np.uint32), value_counts.astype(np.uint32)


def _labels(inp: Input, schema: Schema) -> NDArray[np.float32] | None:
    if inp.has_context or not schema.label or isinstance(inp.items, dict | Scanned):  # a request's columns
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
