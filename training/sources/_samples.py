"""Sample records (``recserve join``'s, read by ``serving.stream.sample_batch``) as the trainer's
batch: a ``CompactBatch`` with labels and no request context (each sample carries its request's
context signs and dense values itself), sparse slots in schema order, dense values in schema order.
One pass per slot, no loop per sample.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from features.batch import FLAG_MULTI, CompactBatch, SlotView
from features.schema import Schema
from serving.stream.sample_batch import Samples


def misfits(s: Samples, schema: Schema) -> list[tuple[int, str]]:
    """(row, reason) of every sample that does not fit ``schema``: another schema hash, slot count,
    multi-valued slots, dense width, or a single-valued slot without exactly one sign."""
    if not s.num_rows:
        return []
    multi = _multi(schema)
    n_ctx = sum(d.scope == "context" for d in schema.dense)
    reasons = [
        (s.schema_hash != schema.hash64, f"sample's schema hash is not {schema.name!r}'s {schema.hash64:016x}"),
        (np.full(s.num_rows, s.flags.shape[1] != len(multi)), f"sample has not the schema's {len(multi)} slots"),
    ]  # fmt: skip
    if s.flags.shape[1] == len(multi):
        is_multi = (s.flags & FLAG_MULTI).astype(bool)
        reasons += [
            ((is_multi != multi).any(axis=1), "sample's multi-valued slots are not the schema's"),
            ((s.lengths[:, ~multi] != 1).any(axis=1), "a single-valued slot of the sample has not one sign"),
        ]
    reasons += [
        (np.full(s.num_rows, s.dense.shape[1] != len(schema.dense)),
         f"sample has not the schema's {len(schema.dense)} dense values"),
        ((s.f_ctx != 0) & (s.f_ctx != n_ctx), f"sample's context dense values are not the schema's {n_ctx}"),
    ]  # fmt: skip
    bad: dict[int, str] = {}
    for mask, why in reversed(reasons):  # the first reason that applies wins
        bad.update(dict.fromkeys(np.flatnonzero(mask).tolist(), why))
    return sorted(bad.items())


def _multi(schema: Schema) -> NDArray[np.bool_]:
    """Per batch slot: multi-valued (a cross is single-valued)."""
    return np.array([getattr(sl, "kind", "") == "multi" for sl in schema.sparse], bool)


def to_batch(s: Samples, schema: Schema) -> CompactBatch:
    """The training batch of samples that fit ``schema`` (``misfits`` found none)."""
    n, slots = s.num_rows, s.lengths.shape[1]
    begin = s.starts[:-1, None] + np.cumsum(s.lengths, axis=1) - s.lengths  # slot s of row r
    views = []
    for j, multi in enumerate(_multi(schema).tolist()):
        counts = s.lengths[:, j]
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        signs = s.signs[np.repeat(begin[:, j], counts) + within]
        uniq, inverse = np.unique(signs, return_inverse=True)
        offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.uint32) if multi else None
        views.append(SlotView(uniq, inverse.astype(np.uint32), offsets, False))
    assert len(views) == slots
    return CompactBatch.from_slots(n, views, _dense(s, schema), labels=s.labels, schema_hash=schema.hash64)


def _dense(s: Samples, schema: Schema) -> NDArray[np.float32]:
    """Dense values in schema order: a sample from a request with a context holds the row's values
    then the context's; put the context's back where the schema has them."""
    is_ctx = np.array([d.scope == "context" for d in schema.dense], bool)
    out = s.dense.copy()
    with_ctx = s.f_ctx > 0
    if with_ctx.any() and is_ctx.any():
        rows = s.dense[with_ctx]
        k = int(is_ctx.sum())
        placed = np.empty_like(rows)
        placed[:, ~is_ctx] = rows[:, : rows.shape[1] - k]
        placed[:, is_ctx] = rows[:, rows.shape[1] - k :]
        out[with_ctx] = placed
    return out


def concat(parts: list[Samples]) -> Samples:
    """The samples of ``parts`` (of one layout: ``misfits`` found none) in order, as one; ``index``
    keeps each part's own."""
    starts = np.concatenate(
        [[0], *(p.starts[1:] + off for p, off in zip(parts, _offsets(parts), strict=True))]
    )
    cat = {f: np.concatenate([getattr(p, f) for p in parts]) for f in
           ("index", "ts", "labels", "schema_hash", "flags", "lengths", "signs", "dense", "f_ctx")}  # fmt: skip
    width = max(p.keys.dtype.itemsize for p in parts)  # request ids of several lengths
    keys = np.concatenate([p.keys.astype(f"S{width}") for p in parts])
    return Samples(keys=keys, starts=starts.astype(np.int64), **cat)


def _offsets(parts: list[Samples]) -> list[int]:
    """Where each part's signs begin in the concatenated signs."""
    sizes = [len(p.signs) for p in parts]
    return [sum(sizes[:i]) for i in range(len(parts))]
