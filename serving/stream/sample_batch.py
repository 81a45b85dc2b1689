"""Many sample records read at once (the streaming trainer's hot path): the layout of
``records.decode_sample`` (one record, the reference reader), validated and gathered with numpy
over the whole batch, no Python loop per record.

``read_samples(values)`` returns the records that are valid as ``Samples`` (arrays, one row per
record, in input order) and, for each invalid one, its index and the reason (``decode_sample``'s
``RecordError`` message where it refuses it; a record it accepts but whose slot count differs
from the batch's first valid record is refused here by name). ``Samples.keys`` are the
(request, item) pairs as fixed-width bytes (the item as 4 big-endian bytes, then the request id; names are not decoded as
utf-8 here):
equal keys are equal pairs, so a set of them dedupes with numpy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from serving.stream.records import _SAM, _SAM_MAGIC, RecordError, decode_sample

HEAD = np.dtype(
    {
        "names": ["magic", "version", "reserved", "ts", "delta_seq", "schema_hash", "item", "label",
                  "slots", "f_row", "f_ctx", "nsigns", "l_rid", "l_emb", "l_dense"],
        "formats": ["S4", "<u2", "<u2", "<f8", "<i8", "<u8", "<u4", "<f4", "<u4", "<u4", "<u4", "<u4",
                    "<u2", "<u2", "<u2"],
        "offsets": [0, 4, 6, 8, 16, 24, 32, 36, 40, 44, 48, 52, 56, 58, 60],
        "itemsize": 64,
    }
)  # fmt: skip
assert HEAD.itemsize == _SAM.size


@dataclass(frozen=True)
class Samples:
    """Valid sample records, one row each, in the order given."""

    index: NDArray[np.int64]  # (N,) where each row was in the input
    keys: NDArray[np.bytes_]  # (N,) (item, request id) as bytes: the dedupe key
    ts: NDArray[np.float64]
    labels: NDArray[np.float32]
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


def _gather(buf: NDArray[np.uint8], at: NDArray[np.int64], width: int) -> NDArray[np.uint8]:
    """(len(at), width) bytes: ``width`` bytes from each offset."""
    return buf[at[:, None] + np.arange(width)]


def _ragged(buf: NDArray[np.uint8], at: NDArray[np.int64], sizes: NDArray[np.int64]) -> NDArray[np.uint8]:
    """``sizes[i]`` bytes from each ``at[i]``, concatenated."""
    total = int(sizes.sum())
    first = np.cumsum(sizes) - sizes
    return buf[np.repeat(at - first, sizes) + np.arange(total)]


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
    (slots, dense values) a record must have (None: those of the first valid record)."""
    n = len(values)
    sizes = np.fromiter(map(len, values), np.int64, n)
    buf = np.frombuffer(b"".join(values), np.uint8)
    begin = np.cumsum(sizes) - sizes
    ok = sizes >= HEAD.itemsize
    head = np.zeros(n, HEAD)
    head[ok] = _gather(buf, begin[ok], HEAD.itemsize).view(HEAD).ravel()
    s, f_row, f_ctx = (head[k].astype(np.int64) for k in ("slots", "f_row", "f_ctx"))
    nsigns = head["nsigns"].astype(np.int64)
    strings = head["l_rid"].astype(np.int64) + head["l_emb"] + head["l_dense"]
    expected = HEAD.itemsize + strings + 5 * s + 8 * nsigns + 4 * (f_row + f_ctx)
    ok &= (head["magic"] == _SAM_MAGIC) & (head["version"] == 1) & (expected == sizes)
    ok &= np.isfinite(head["ts"]) & np.isfinite(head["label"])
    slots = shape[0] if shape is not None else int(s[ok][0]) if ok.any() else 0
    ok &= s == slots  # one (N, S) layout for the batch
    # the variable part, for the records whose header holds so far
    at = begin + HEAD.itemsize + strings  # flags, then lengths u32[S], signs, dense, context dense
    idx = np.flatnonzero(ok)
    flags = _gather(buf, at[idx], slots)
    lengths = _gather(buf, at[idx] + slots, 4 * slots).view("<u4").astype(np.int64)
    fits = lengths.sum(axis=1) == nsigns[idx]
    width = f_row + f_ctx
    dense_ok: NDArray[np.bool_] = np.ones(len(idx), bool)
    dense_w = shape[1] if shape is not None else int(width[idx][0]) if len(idx) else 0
    same_w = width[idx] == dense_w
    dense = np.zeros((len(idx), dense_w), np.float32)
    if dense_w:
        end = begin[idx] + sizes[idx]
        rows = np.flatnonzero(same_w)
        dense[rows] = _gather(buf, end[rows] - 4 * dense_w, 4 * dense_w).view("<f4")
        dense_ok = np.asarray(np.isfinite(dense).all(axis=1))
    keep = fits & dense_ok & same_w
    ok[idx[~keep]] = False
    idx, flags, lengths, dense = idx[keep], flags[keep], lengths[keep], dense[keep]
    signs = _ragged(buf, at[idx] + 5 * slots, 8 * nsigns[idx]).view("<u8")
    l_rid = head["l_rid"][idx].astype(np.int64)
    rid_w = int(l_rid.max(initial=0))
    rid = _gather(buf, begin[idx] + HEAD.itemsize, rid_w) if rid_w else np.zeros((len(idx), 0), np.uint8)
    rid[np.arange(rid_w) >= l_rid[:, None]] = 0
    item = head["item"][idx].astype(">u4").view(np.uint8).reshape(-1, 4)
    keys = np.ascontiguousarray(np.hstack([item, rid])).view(f"S{4 + rid_w}").ravel()
    starts = np.zeros(len(idx) + 1, np.int64)
    np.cumsum(nsigns[idx], out=starts[1:])
    samples = Samples(
        index=idx,
        keys=keys,
        ts=head["ts"][idx].copy(),
        labels=head["label"][idx].astype(np.float32),
        schema_hash=head["schema_hash"][idx].copy(),
        flags=flags,
        lengths=lengths,
        starts=starts,
        signs=signs,
        dense=dense,
        f_ctx=f_ctx[idx],
    )
    return samples, _reasons(values, np.flatnonzero(~ok), slots, dense_w)


def take(s: Samples, rows: NDArray[np.int64]) -> Samples:
    """The samples at ``rows`` (positions in ``s``), in that order."""
    sizes = np.diff(s.starts)[rows]
    starts = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(sizes, out=starts[1:])
    first = np.cumsum(sizes) - sizes
    signs = s.signs[np.repeat(s.starts[:-1][rows] - first, sizes) + np.arange(int(sizes.sum()))]
    return Samples(
        index=s.index[rows], keys=s.keys[rows], ts=s.ts[rows], labels=s.labels[rows],
        schema_hash=s.schema_hash[rows], flags=s.flags[rows], lengths=s.lengths[rows], starts=starts,
        signs=signs, dense=s.dense[rows], f_ctx=s.f_ctx[rows],
    )  # fmt: skip
