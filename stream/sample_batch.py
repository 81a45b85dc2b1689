"""Many sample records read at once (the streaming trainer's hot path): the layout of
``records.decode_sample`` (one record, the reference reader), validated and gathered with numpy
over the whole batch, no Python loop per record.

``read_samples(values)`` returns the records that are valid as ``Samples`` (arrays, one row per
record, in input order) and, for each invalid one, its index and the reason (``decode_sample``'s
``RecordError`` message where it refuses it; a record it accepts but whose slot count differs
from the batch's first valid record is refused here by name). ``Samples.keys`` are the
(request, item, kind) triples as fixed-width bytes (the item as 4 big-endian bytes, its top bit set
for a correction (``KIND_BIT``), then the request id; names are not decoded as utf-8 here): equal
keys are equal triples, so a set of them dedupes with numpy.

The batch's other operations live here too, so the sample layout is written once: ``take`` (rows
by position), ``concat`` (several reads as one), ``misfits`` (rows that do not fit a schema) and
``to_batch`` (the trainer's ``CompactBatch``: labels, no request context, sparse and dense slots in
schema order; the signs of every slot deduplicated by one compiled pass, no loop per sample or per
slot) and ``to_batches`` (the batches of many spans of rows, a stream's looks, in one such pass).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
from numpy.typing import NDArray

from features.batch import FLAG_MULTI, CompactBatch, index_dtype
from features.schema import Schema
from stream.records import _SAM_MAGIC, CORRECTION, SAMPLE_VERSION, RecordError, decode_sample
from stream.records import SAMPLE_HEAD as HEAD  # the header's layout, written once there

KIND_BIT = 1 << 31
"""The bit of a key's item word that marks a correction (a request's items are far fewer)."""


@dataclass(frozen=True)
class Samples:
    """Valid sample records, one row each, in the order given."""

    index: NDArray[np.int64]  # (N,) where each row was in the input
    keys: NDArray[np.bytes_]  # (N,) (item | kind bit, request id) as bytes: the dedupe key
    ts: NDArray[np.float64]
    labels: NDArray[np.float32]
    scores: NDArray[np.float32]  # what the served model predicted
    deltas: NDArray[np.int64]  # the embedding version's delta that served it
    arms: NDArray[np.bytes_]  # the experiment arm that scored it (b"": none)
    kinds: NDArray[np.uint8]  # LABEL or CORRECTION (stream.records)
    elapsed: NDArray[np.float32]  # event-time seconds from the impression to the label
    schema_hash: NDArray[np.uint64]
    flags: NDArray[np.uint8]  # (N, S) slot flags (FLAG_CONTEXT, FLAG_MULTI)
    lengths: NDArray[np.int64]  # (N, S) signs of row r in slot s
    starts: NDArray[np.int64]  # (N + 1,) row r's signs are signs[starts[r]:starts[r+1]], slot after slot
    signs: NDArray[np.uint64]
    dense: NDArray[np.float32]  # (N, F_row + F_ctx): the row's dense values, then the context's
    f_ctx: NDArray[np.int64]  # (N,) how many of a row's dense values are the context's (at the end)

    @property
    def num_rows(self) -> int:
        return len(self.index)


_RAGGED = ("starts", "signs")
"""The fields that are not one entry per row (row r's signs are signs[starts[r]:starts[r+1]])."""
_PER_ROW = tuple(f.name for f in fields(Samples) if f.name not in _RAGGED)
"""Every other field: one entry per row, taken and joined alike (a new one needs no code here)."""


def _gather(buf: NDArray[np.uint8], at: NDArray[np.int64], width: int) -> NDArray[np.uint8]:
    """(len(at), width) bytes: ``width`` bytes from each offset."""
    return buf[at[:, None] + np.arange(width)]


def _text(buf: NDArray[np.uint8], at: NDArray[np.int64], sizes: NDArray[np.int64]) -> NDArray[np.bytes_]:
    """``sizes[i]`` bytes from each ``at[i]`` as fixed-width bytes (zero-padded: b"" where none)."""
    width = int(sizes.max(initial=0))
    if not width:
        return np.zeros(len(at), "S1")
    out = buf[np.minimum(at[:, None] + np.arange(width), len(buf) - 1)]  # past a text: masked below
    out[np.arange(width) >= sizes[:, None]] = 0
    return np.ascontiguousarray(out).view(f"S{width}").ravel()


def _reasons(values: list[bytes], bad: NDArray[np.int64], slots: int, dense: int) -> list[tuple[int, str]]:
    """Why each refused record is refused (the rare path: one record at a time)."""
    out = []
    for i in bad.tolist():
        try:
            s = decode_sample(values[i])
        except RecordError as e:
            out.append((i, str(e)))
            continue
        shape = (len(s.row.flags), len(s.row.dense) + len(s.row.context_dense))
        out.append((i, f"sample has (slots, dense values) {shape}, expected {(slots, dense)}"))
    return out


def read_samples(values: list[bytes], shape: tuple[int, int] | None = None) -> tuple[Samples, list[tuple[int, str]]]:  # fmt: skip
    """The valid records of ``values`` and (index, reason) for each invalid one. ``shape``: the
    (slots, dense values) a record must have (None: those of the first valid record). The headers
    are checked with numpy, the variable parts gathered by one compiled pass
    (``stream.sample_kernels.gather_rows``, no GIL held)."""
    from stream.sample_kernels import gather_rows

    n = len(values)
    sizes = np.fromiter(map(len, values), np.int64, n)
    buf = np.frombuffer(b"".join(values), np.uint8)
    begin = np.cumsum(sizes) - sizes
    ok = sizes >= HEAD.itemsize
    head = np.zeros(n, HEAD)
    head[ok] = _gather(buf, begin[ok], HEAD.itemsize).view(HEAD).ravel()
    s, f_row, f_ctx = (head[k].astype(np.int64) for k in ("slots", "f_row", "f_ctx"))
    nsigns = head["nsigns"].astype(np.int64)
    strings = head["l_rid"].astype(np.int64) + head["l_emb"] + head["l_dense"] + head["l_arm"]
    expected = HEAD.itemsize + strings + 5 * s + 8 * nsigns + 4 * (f_row + f_ctx)
    ok &= (head["magic"] == _SAM_MAGIC) & (head["version"] == SAMPLE_VERSION) & (expected == sizes)
    ok &= np.isfinite(head["ts"]) & np.isfinite(head["label"]) & np.isfinite(head["score"])
    ok &= np.isfinite(head["elapsed"]) & (head["kind"] <= CORRECTION)
    slots = shape[0] if shape is not None else int(s[ok][0]) if ok.any() else 0
    ok &= s == slots  # one (N, S) layout for the batch
    # the variable part, for the records whose header holds so far
    at = begin + HEAD.itemsize + strings  # flags, then lengths u32[S], signs, dense, context dense
    idx = np.flatnonzero(ok)
    width = f_row + f_ctx
    dense_w = shape[1] if shape is not None else int(width[idx][0]) if len(idx) else 0
    kinds = head["kind"][idx]
    item = head["item"][idx] | kinds.astype(np.uint32) << 31  # the key's item word: a correction's bit
    flags, lengths, dense, keep, signs, key_bytes = gather_rows(
        buf, at[idx], begin[idx] + sizes[idx], nsigns[idx], width[idx] == dense_w,
        begin[idx] + HEAD.itemsize, head["l_rid"][idx].astype(np.int64), item, slots, dense_w,
    )  # fmt: skip
    if not keep.all():
        ok[idx[~keep]] = False
        idx, flags, lengths, dense, kinds = idx[keep], flags[keep], lengths[keep], dense[keep], kinds[keep]
    keys = key_bytes.view(f"S{key_bytes.shape[1]}").ravel()
    l_arm = head["l_arm"][idx].astype(np.int64)
    arm_at = begin[idx] + HEAD.itemsize + strings[idx] - l_arm
    arms = _text(buf, arm_at, l_arm)
    starts = np.zeros(len(idx) + 1, np.int64)
    np.cumsum(nsigns[idx], out=starts[1:])
    samples = Samples(
        index=idx,
        keys=keys,
        ts=head["ts"][idx].copy(),
        labels=head["label"][idx].astype(np.float32),
        scores=head["score"][idx].astype(np.float32),
        deltas=head["delta_seq"][idx].astype(np.int64),
        arms=arms,
        kinds=kinds,
        elapsed=head["elapsed"][idx].astype(np.float32),
        schema_hash=head["schema_hash"][idx].copy(),
        flags=flags,
        lengths=lengths,
        starts=starts,
        signs=signs,
        dense=dense,
        f_ctx=f_ctx[idx],
    )
    return samples, _reasons(values, np.flatnonzero(~ok), slots, dense_w)


def request_ids(keys: NDArray[np.bytes_]) -> NDArray[np.bytes_]:
    """The request id of each key (its bytes after the item's four), fixed-width, as numpy sees
    them (equal ids are equal entries)."""
    keys = np.ascontiguousarray(keys)
    width = keys.dtype.itemsize
    if width <= 4:
        return np.zeros(len(keys), "S1")
    return (
        np.ascontiguousarray(keys.view(np.uint8).reshape(len(keys), width)[:, 4:])
        .view(f"S{width - 4}")
        .ravel()
    )


def take(s: Samples, rows: NDArray[np.int64]) -> Samples:
    """The samples at ``rows`` (positions in ``s``), in that order."""
    sizes = np.diff(s.starts)[rows]
    starts = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(sizes, out=starts[1:])
    first = np.cumsum(sizes) - sizes
    signs = s.signs[np.repeat(s.starts[:-1][rows] - first, sizes) + np.arange(int(sizes.sum()))]
    return Samples(starts=starts, signs=signs, **{f: getattr(s, f)[rows] for f in _PER_ROW})


def span(s: Samples, lo: int, hi: int) -> Samples:
    """Rows ``lo`` to ``hi`` (excluded) of ``s``: views of its arrays, not a gather."""
    first, end = int(s.starts[lo]), int(s.starts[hi])
    return Samples(starts=s.starts[lo : hi + 1] - first, signs=s.signs[first:end], **{f: getattr(s, f)[lo:hi] for f in _PER_ROW})  # fmt: skip


def read_fitting(values: list[bytes], schema: Schema) -> tuple[Samples, list[tuple[int, str]]]:
    """The records of ``values`` that are valid samples of ``schema`` (a source's read: what it
    trains) and (index, reason) for every other one (what it sends to its dead-letter topic)."""
    samples, bad = read_samples(values, (len(schema.sparse), len(schema.dense)))
    misfit = misfits(samples, schema)
    if not misfit:
        return samples, bad
    fits = np.ones(samples.num_rows, bool)
    fits[[r for r, _ in misfit]] = False
    return take(samples, np.flatnonzero(fits)), bad + [(int(samples.index[r]), why) for r, why in misfit]


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
    """The training batch of samples that fit ``schema`` (``misfits`` found none): the signs
    gathered slot after slot and deduplicated by the compiled dedup, no loop per sample or per
    slot (``to_batches`` of one span)."""
    return to_batches(s, np.array([0, s.num_rows], np.int64), schema)[0]


def to_batches(s: Samples, bounds: NDArray[np.int64], schema: Schema) -> list[CompactBatch]:
    """``to_batch`` of each span of rows ``bounds[i]`` to ``bounds[i + 1]`` (excluded) of ``s``:
    one compiled call gathers and deduplicates the signs of all of them (``dedup_spans``, no GIL
    held), the dense values are put in schema order once; each batch's dense values and labels
    are views of those."""
    from features.transform import dedup_spans

    multi = _multi(schema)
    assert len(multi) == s.lengths.shape[1]
    uniq, local, sign_counts, value_counts = dedup_spans(s.signs, s.starts, s.lengths, bounds, schema)
    u_at, v_at = (
        np.concatenate([[0], np.cumsum(c.sum(axis=1))]).tolist() for c in (sign_counts, value_counts)
    )
    widths = sign_counts.max(axis=1, initial=0).tolist()
    dense = np.ascontiguousarray(_dense(s, schema), np.float32)
    labels = np.ascontiguousarray(s.labels, np.float32)
    flags = (multi * FLAG_MULTI).astype(np.uint8)
    counts = sign_counts.astype(np.uint32), value_counts.astype(np.uint32)
    edges = np.asarray(bounds, np.int64).tolist()
    types = [index_dtype(w) for w in widths]
    as_type = {t: local.astype(t) for t in set(types)}  # each batch's values: a view of one of these
    return [
        CompactBatch(
            num_rows=b - a,
            flags=flags,
            sign_counts=counts[0][i],
            value_counts=counts[1][i],
            signs=uniq[u_at[i] : u_at[i + 1]],
            values=as_type[types[i]][v_at[i] : v_at[i + 1]],
            offsets=_multi_offsets(s.lengths[a:b, multi]) if multi.any() else np.zeros(0, np.uint32),
            dense=dense[a:b],
            context_dense=np.zeros(0, np.float32),
            labels=labels[a:b],
            schema_hash=schema.hash64,
        )
        for i, (a, b) in enumerate(zip(edges[:-1], edges[1:], strict=True))
    ]


def _multi_offsets(lengths: NDArray[np.int64]) -> NDArray[np.uint32]:
    """A batch's offsets of its multi-valued slots (``lengths``: rows by those slots): each slot's
    rows' ends, after a 0, one slot after the other."""
    ends = np.cumsum(lengths, axis=0).T.astype(np.uint32)  # (multi slots, N)
    return np.concatenate([np.zeros((len(ends), 1), np.uint32), ends], axis=1).ravel()


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
    cat = {f: np.concatenate([getattr(p, f) for p in parts]) for f in (*_PER_ROW, "signs") if f != "keys"}
    width = max(p.keys.dtype.itemsize for p in parts)  # request ids of several lengths
    keys = np.concatenate([p.keys.astype(f"S{width}") for p in parts])
    return Samples(keys=keys, starts=starts.astype(np.int64), **cat)


def _offsets(parts: list[Samples]) -> list[int]:
    """Where each part's signs begin in the concatenated signs."""
    sizes = [len(p.signs) for p in parts]
    return [sum(sizes[:i]) for i in range(len(parts))]
