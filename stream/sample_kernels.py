"""The compiled half of ``stream.sample_batch.read_samples``: the per-record variable parts of many
sample records gathered in one pass that holds no GIL (the streaming trainer's reading thread
decodes while the step runs; a few dozen numpy gathers a consume held the GIL the step needs).

numba, imported on first use as ``features.kernels`` is: a process that never decodes samples
does not load LLVM. Values are copied as bytes into typed arrays (the records' words are not
aligned), so the layout is ``stream.records``' little-endian one as written there.
"""

from __future__ import annotations

import numba
import numpy as np
from numpy.typing import NDArray


@numba.njit(cache=True, nogil=True)
def gather_rows(
    buf: NDArray[np.uint8],
    at: NDArray[np.int64],
    end: NDArray[np.int64],
    nsigns: NDArray[np.int64],
    same_w: NDArray[np.bool_],
    rid_at: NDArray[np.int64],
    l_rid: NDArray[np.int64],
    item_word: NDArray[np.uint32],
    slots: int,
    dense_w: int,
) -> tuple[NDArray[np.uint8], NDArray[np.int64], NDArray[np.float32], NDArray[np.bool_], NDArray[np.uint64], NDArray[np.uint8]]:  # fmt: skip
    """Record i's variable part begins at ``buf[at[i]]`` (flags u8[slots], lengths u32[slots],
    ``nsigns[i]`` signs u64) and ends at ``end[i]`` with its ``dense_w`` float32 dense values
    (read where ``same_w[i]``: the record has that many); its request id is ``l_rid[i]`` bytes at
    ``rid_at[i]``. Returns every record's flags, lengths and dense values, whether it is kept (its
    lengths sum to its sign count, its dense values are as many and finite), and for the kept ones
    only, in order: their signs one after the other, and their keys as rows of bytes (the item
    word big-endian, then the request id, zero-padded to the longest)."""
    n = len(at)
    flags = np.empty((n, slots), np.uint8)
    lengths = np.empty((n, slots), np.int64)
    dense = np.zeros((n, dense_w), np.float32)
    dense_bytes = dense.reshape(-1).view(np.uint8)
    keep = np.empty(n, np.bool_)
    total, kept, rid_w = 0, 0, 0
    for i in range(n):
        s = np.int64(0)
        for j in range(slots):
            flags[i, j] = buf[at[i] + j]
            p = at[i] + slots + 4 * j
            v = (
                np.int64(buf[p])
                | np.int64(buf[p + 1]) << 8
                | np.int64(buf[p + 2]) << 16
                | np.int64(buf[p + 3]) << 24
            )
            lengths[i, j] = v
            s += v
        ok = s == nsigns[i] and same_w[i]
        if same_w[i] and dense_w:
            w = 4 * dense_w
            dense_bytes[i * w : (i + 1) * w] = buf[end[i] - w : end[i]]
            for j in range(dense_w):
                ok = ok and np.isfinite(dense[i, j])
        keep[i] = ok
        if ok:
            total += nsigns[i]
            kept += 1
            rid_w = max(rid_w, l_rid[i])
    signs = np.empty(total, np.uint64)
    sign_bytes = signs.view(np.uint8)
    keys = np.zeros((kept, 4 + rid_w), np.uint8)
    k, r = 0, 0
    for i in range(n):
        if not keep[i]:
            continue
        m = 8 * nsigns[i]
        base = at[i] + 5 * slots
        sign_bytes[k : k + m] = buf[base : base + m]
        k += m
        word = item_word[i]
        for b in range(4):
            keys[r, b] = np.uint8((word >> np.uint32(24 - 8 * b)) & np.uint32(0xFF))
        keys[r, 4 : 4 + l_rid[i]] = buf[rid_at[i] : rid_at[i] + l_rid[i]]
        r += 1
    return flags, lengths, dense, keep, signs, keys
