"""Compiled kernels of the PS store: the open-addressing sign -> row position index, deterministic row
initialisation and the admission sketch.

The index is a table of int32 entries (-1 = empty) with linear probing; the signs themselves
live once, in the store's ``keys`` array (``keys[row_at]``), so an entry costs 4 bytes of table
plus nothing else. An entry holds the row position in its low ``bits`` bits and a fingerprint of
the sign (other hash bits) in the remaining bits up to 31: probing past other signs' entries
then almost never touches ``keys`` (a random cache miss each), only the one that matches. Deletion uses backward shifting, so there are no tombstones
and probe lengths do not degrade under churn.

The table size is exactly ceil(capacity / MAX_LOAD) (no rounding to a power of two, which would
cost up to 2x index memory); a sign's home entry is the high 32 bits of a salted splitmix64 of the
sign scaled to the size (multiply-shift). ``shard_of`` routes by ``mix64(sign) % num_shards``, so
inside one shard the low bits of ``mix64`` are correlated with the shard number; the high bits of
a differently salted mix keep the table uniform.
"""

from __future__ import annotations

import numba
import numpy as np

from features.hashing import TABLE_SALT as _SALT

EMPTY = np.int32(-1)
MAX_LOAD = 0.6  # table load factor bound: capacity <= MAX_LOAD * table size

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S11 = np.uint64(11)
_S32 = np.uint64(32)
_INV53 = 1.0 / 9007199254740992.0  # 2**-53


def position_bits(capacity: int) -> int:
    """Bits of an entry that hold the row position (the rest, up to 31, are fingerprint)."""
    return max(1, (capacity - 1).bit_length())


def table_size(capacity: int) -> int:
    """Index entries for ``capacity`` rows at load <= MAX_LOAD (at least 16)."""
    return max(int(np.ceil(capacity / MAX_LOAD)), 16)


@numba.njit(inline="always")
def _mix(z):
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


@numba.njit(inline="always")
def _hash(sign):
    return _mix(sign ^ _SALT)


@numba.njit(inline="always")
def _home(h, size):
    return np.int64(((h >> _S32) * np.uint64(size)) >> _S32)


@numba.njit(inline="always")
def _next(pos, size):
    pos += 1
    return 0 if pos == size else pos


@numba.njit(inline="always")
def _masks(bits):
    """(row-position mask, fingerprint mask) for ``bits`` row-position bits."""
    return np.int64((1 << bits) - 1), np.uint64((1 << (31 - bits)) - 1)


@numba.njit(inline="always")
def _find(table, keys, s, h, pos, bits):
    """Probe from entry ``pos`` for sign ``s`` (hash ``h``): its row position or -1."""
    size = len(table)
    smask, fmask = _masks(bits)
    fp = np.int64(h & fmask)
    while True:
        e = np.int64(table[pos])
        if e < 0:
            return -1
        if (e >> bits) == fp:
            row_at = e & smask
            if keys[row_at] == s:
                return row_at
        pos = _next(pos, size)


@numba.njit(cache=True, nogil=True)
def bucket_find(keys, buckets, signs, bits):
    """``serving.ps.table.BucketTable.find`` compiled: each sign's row position in a full dump's keys, or
    -1. Sign s lives in bucket ``table_hash(s) >> (64 - bits)``, keys[buckets[b]:buckets[b + 1]]."""
    out = np.full(len(signs), -1, dtype=np.int64)
    shift = np.uint64(64 - bits)
    for i in range(len(signs)):
        s = signs[i]
        b = np.int64(_hash(s) >> shift)
        for k in range(np.int64(buckets[b]), np.int64(buckets[b + 1])):
            if keys[k] == s:
                out[i] = k
                break
    return out


@numba.njit(cache=True, nogil=True)
def find_positions(table, keys, signs, bits):
    """Slot of each sign, -1 where absent."""
    size = len(table)
    out = np.empty(len(signs), dtype=np.int32)
    for i in range(len(signs)):
        h = _hash(signs[i])
        out[i] = _find(table, keys, signs[i], h, _home(h, size), bits)
    return out


@numba.njit(cache=True, nogil=True)
def gather_rows(table, keys, rows, signs, bits, out):
    """Fused lookup + gather for float32 storage: out[i] = rows[position(signs[i])] or zeros.
    Returns the number of misses.

    Works in blocks of 32 signs and three passes (table by fingerprint, key check, row copy),
    so the cache misses of different signs are independent and overlap in the memory system;
    one sign at a time would wait for three dependent misses in a row."""
    size = len(table)
    smask, fmask = _masks(bits)
    dim = rows.shape[1]
    n = len(signs)
    B = 32
    cand = np.empty(B, dtype=np.int64)
    where = np.empty(B, dtype=np.int64)
    misses = 0
    for b0 in range(0, n, B):
        m = min(B, n - b0)
        for k in range(m):  # pass 1: the first entry whose fingerprint matches
            h = _hash(signs[b0 + k])
            pos = _home(h, size)
            fp = np.int64(h & fmask)
            row_at = -1
            while True:
                e = np.int64(table[pos])
                if e < 0:
                    break
                if (e >> bits) == fp:
                    row_at = e & smask
                    break
                pos = _next(pos, size)
            cand[k] = row_at
            where[k] = pos
        for k in range(m):  # pass 2: confirm the key; a fingerprint collision probes on
            row_at = cand[k]
            s = signs[b0 + k]
            if row_at >= 0 and keys[row_at] != s:
                cand[k] = _find(table, keys, s, _hash(s), _next(where[k], size), bits)
        for k in range(m):  # pass 3: copy the rows
            row_at = cand[k]
            i = b0 + k
            if row_at < 0:
                misses += 1
                for j in range(dim):
                    out[i, j] = 0.0
            else:
                for j in range(dim):
                    out[i, j] = rows[row_at, j]
    return misses


@numba.njit(inline="always")
def _put(table, h, row_at, bits):
    size = len(table)
    _, fmask = _masks(bits)
    pos = _home(h, size)
    while table[pos] >= 0:
        pos = _next(pos, size)
    table[pos] = np.int32((np.int64(h & fmask) << bits) | row_at)


@numba.njit(cache=True, nogil=True)
def insert_new(table, keys, signs, start, bits):
    """Insert distinct, absent ``signs`` at positions start, start+1, ... (keys written too)."""
    for i in range(len(signs)):
        keys[start + i] = signs[i]
        _put(table, _hash(signs[i]), start + i, bits)


@numba.njit(cache=True, nogil=True)
def rebuild(table, keys, n, bits):
    """Index keys[:n] (a sign's position = its place in keys). Returns the number of duplicate signs found (0 when
    the input is consistent); duplicates are not indexed."""
    size = len(table)
    table[:] = EMPTY
    dups = 0
    for row_at in range(n):
        h = _hash(keys[row_at])
        if _find(table, keys, keys[row_at], h, _home(h, size), bits) >= 0:
            dups += 1
        else:
            _put(table, h, row_at, bits)
    return dups


@numba.njit(inline="always")
def _delete_at(table, keys, pos, bits):
    """Backward-shift deletion of the entry at ``pos``."""
    size = len(table)
    smask, _ = _masks(bits)
    i = pos
    j = pos
    while True:
        j = _next(j, size)
        e = np.int64(table[j])
        if e < 0:
            break
        k = _home(_hash(keys[e & smask]), size)
        # the entry at j may move to i only if its home is not cyclically inside (i, j]
        if i <= j:
            if i < k <= j:
                continue
        elif k > i or k <= j:
            continue
        table[i] = table[j]
        i = j
    table[i] = EMPTY


@numba.njit(inline="always")
def _entry_of(table, keys, row_at, bits):
    """The table entry that points at row position ``row_at``."""
    size = len(table)
    smask, _ = _masks(bits)
    pos = _home(_hash(keys[row_at]), size)
    while table[pos] < 0 or (np.int64(table[pos]) & smask) != row_at:
        pos = _next(pos, size)
    return pos


@numba.njit(cache=True, nogil=True)
def remove_compact(table, keys, victims, n, bits):
    """Remove the rows at the sorted distinct positions ``victims`` (all < n) and keep rows dense:
    the surviving rows at the tail fill the holes. Moves keys and the index; returns (src, dst)
    so the caller moves every other per-row array the same way (src >= new n > dst)."""
    smask, _ = _masks(bits)
    for v in victims:
        _delete_at(table, keys, _entry_of(table, keys, v, bits), bits)
    m = len(victims)
    new_n = n - m
    gone = np.zeros(n - new_n, dtype=np.bool_)  # victims in the tail [new_n, n)
    holes = 0
    for v in victims:
        if v >= new_n:
            gone[v - new_n] = True
        else:
            holes += 1
    src = np.empty(holes, dtype=np.int64)
    dst = np.empty(holes, dtype=np.int64)
    j = new_n
    h = 0
    for v in victims:
        if v >= new_n:
            break
        while gone[j - new_n]:
            j += 1
        pos = _entry_of(table, keys, j, bits)
        table[pos] = np.int32((np.int64(table[pos]) & ~smask) | v)  # same key: keep its fingerprint
        keys[v] = keys[j]
        src[h] = j
        dst[h] = v
        h += 1
        j += 1
    return src, dst


@numba.njit(cache=True, nogil=True)
def init_rows(signs, dim, seed, scale):
    """Deterministic initial rows: element (i, j) is uniform(-scale, scale) drawn from a
    counter-based hash of (sign, j, seed), so a sign gets the same row in every process."""
    out = np.empty((len(signs), dim), dtype=np.float32)
    for i in range(len(signs)):
        base = signs[i] ^ seed
        for j in range(dim):
            z = _mix(base ^ (np.uint64(j + 1) * _GOLDEN))
            u = np.float64(z >> _S11) * _INV53
            out[i, j] = np.float32((2.0 * u - 1.0) * scale)
    return out


@numba.njit(cache=True, nogil=True)
def sketch_add(sketch, signs, counts):
    """Count-min sketch (depth x 2**k uint16, saturating): add ``counts`` for ``signs`` and
    return the new estimates (never below the true count)."""
    depth, width = sketch.shape
    mask = np.uint64(width - 1)
    out = np.empty(len(signs), dtype=np.int64)
    for i in range(len(signs)):
        z = _mix(signs[i] ^ _SALT)
        est = 1 << 30
        for d in range(depth):
            z = _mix(z + _GOLDEN)
            pos = np.int64(z & mask)
            c = np.int64(sketch[d, pos]) + counts[i]
            if c > 65535:
                c = 65535
            sketch[d, pos] = c
            if c < est:
                est = c
        out[i] = est
    return out


@numba.njit(cache=True, nogil=True)
def segment_sum(inverse, values, k):
    """out[inverse[i]] += values[i]: sums the gradients of duplicate signs, in input order."""
    out = np.zeros((k, values.shape[1]), dtype=np.float32)
    for i in range(len(inverse)):
        r = inverse[i]
        for j in range(values.shape[1]):
            out[r, j] += values[i, j]
    return out


@numba.njit(inline="always")
def find_one(table, keys, sign, bits):
    """The row position of one sign, -1 where absent: for kernels that fuse the find with their work on
    the row (``serving.ps.fused``)."""
    h = _hash(sign)
    return _find(table, keys, sign, h, _home(h, len(table)), bits)


@numba.njit(cache=True, nogil=True)
def touch_gather(rows_at, rows, stamp, count, now, out):
    """A training lookup's second half by position: out[i] = rows[rows_at[i]] (zeros where -1), each
    found row's stamp set to ``now`` and its count raised (saturating). Returns the misses."""
    misses = 0
    for i in range(len(rows_at)):
        s = rows_at[i]
        if s < 0:
            out[i, :] = 0.0
            misses += 1
            continue
        out[i, :] = rows[s, :]
        stamp[s] = now
        if count[s] < np.uint32(0xFFFFFFFF):
            count[s] += np.uint32(1)
    return misses
