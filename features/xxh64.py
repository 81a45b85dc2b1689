"""XXH64 compiled with numba: the reference 64-bit xxHash over bytes, and the two batch kernels
that turn string values into signs (``features.hashing`` calls them; the binary batch codec
checks its payloads with ``xxh64``).

Kept apart from ``features.hashing`` so that a process that only routes signs (``shard_of``,
``mix64``: numpy) -- a serving PS shard -- never imports numba, which costs ~120 MB of resident
memory per process (LLVM and the loaded kernels).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from numpy.typing import NDArray

U64 = np.uint64
Int = int | np.integer[Any]  # numba kernels take Python ints and numpy ints alike

_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_P5 = np.uint64(0x27D4EB2F165667C5)


@numba.njit(inline="always")
def _rotl(x: U64, r: int) -> U64:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


@numba.njit(inline="always")
def _round(acc: U64, lane: U64) -> U64:
    acc = acc + lane * _P2
    acc = _rotl(acc, 31)
    return acc * _P1


@numba.njit(inline="always")
def _merge(acc: U64, val: U64) -> U64:
    acc = acc ^ _round(np.uint64(0), val)
    return acc * _P1 + _P4


@numba.njit(inline="always")
def _read_le(buf: NDArray[np.uint8], i: Int, width: int) -> U64:
    """``width`` bytes of buf at i, little-endian, as uint64."""
    v = np.uint64(0)
    for k in range(width):
        v |= np.uint64(buf[i + k]) << np.uint64(8 * k)
    return v


@numba.njit(inline="always")
def read64(buf: NDArray[np.uint8], i: Int) -> U64:
    return _read_le(buf, i, 8)


@numba.njit(inline="always")
def xxh64_at(buf: NDArray[np.uint8], start: Int, n: Int, seed: U64) -> U64:
    """XXH64 of buf[start:start + n] (the reference algorithm, checked against the xxhash
    package), inlined where it is called: no slice, no call per value."""
    i = start
    end = start + n
    if n >= 32:
        v1 = seed + _P1 + _P2
        v2 = seed + _P2
        v3 = seed
        v4 = seed - _P1
        while i + 32 <= end:
            v1 = _round(v1, read64(buf, i))
            v2 = _round(v2, read64(buf, i + 8))
            v3 = _round(v3, read64(buf, i + 16))
            v4 = _round(v4, read64(buf, i + 24))
            i += 32
        h = _rotl(v1, 1) + _rotl(v2, 7) + _rotl(v3, 12) + _rotl(v4, 18)
        h = _merge(h, v1)
        h = _merge(h, v2)
        h = _merge(h, v3)
        h = _merge(h, v4)
    else:
        h = seed + _P5
    h = h + np.uint64(n)
    while i + 8 <= end:
        h = h ^ _round(np.uint64(0), read64(buf, i))
        h = _rotl(h, 27) * _P1 + _P4
        i += 8
    if i + 4 <= end:
        h = h ^ (_read_le(buf, i, 4) * _P1)
        h = _rotl(h, 23) * _P2 + _P3
        i += 4
    while i < end:
        h = h ^ (np.uint64(buf[i]) * _P5)
        h = _rotl(h, 11) * _P1
        i += 1
    h = h ^ (h >> np.uint64(33))
    h = h * _P2
    h = h ^ (h >> np.uint64(29))
    h = h * _P3
    h = h ^ (h >> np.uint64(32))
    return h


@numba.njit(cache=True)
def xxh64(buf: NDArray[np.uint8], n: Int, seed: U64) -> U64:
    """XXH64 of buf[:n] (the reference algorithm, checked against the xxhash package)."""
    return xxh64_at(buf, 0, n, seed)


@numba.njit(cache=True)
def hash_codepoints(
    cps: NDArray[np.uint32], seed: U64, prefixes: NDArray[np.uint64], mask: U64
) -> NDArray[np.uint64]:
    """Signs of the rows of a (n, width) UTF-32 code-point matrix (a numpy 'U' array viewed as
    uint32): each row is UTF-8 encoded into a scratch buffer, hashed, masked and given the prefix
    of its row (``prefixes`` has one entry per row, or a single entry for all)."""
    one = len(prefixes) == 1
    n, width = cps.shape
    out = np.empty(n, dtype=np.uint64)
    buf = np.empty(4 * width + 1, dtype=np.uint8)
    for r in range(n):
        length = width
        while length > 0 and cps[r, length - 1] == 0:  # numpy pads 'U' strings with NULs
            length -= 1
        m = 0
        for j in range(length):
            c = cps[r, j]
            if c < 0x80:
                buf[m] = c
                m += 1
            elif c < 0x800:
                buf[m] = 0xC0 | (c >> 6)
                buf[m + 1] = 0x80 | (c & 0x3F)
                m += 2
            elif c < 0x10000:
                buf[m] = 0xE0 | (c >> 12)
                buf[m + 1] = 0x80 | ((c >> 6) & 0x3F)
                buf[m + 2] = 0x80 | (c & 0x3F)
                m += 3
            else:
                buf[m] = 0xF0 | (c >> 18)
                buf[m + 1] = 0x80 | ((c >> 12) & 0x3F)
                buf[m + 2] = 0x80 | ((c >> 6) & 0x3F)
                buf[m + 3] = 0x80 | (c & 0x3F)
                m += 4
        out[r] = prefixes[0 if one else r] | (xxh64(buf, m, seed) & mask)
    return out


@numba.njit(cache=True)
def hash_joined(
    buf: NDArray[np.uint8], n_values: int, seed: U64, prefixes: NDArray[np.uint64], per: int, mask: U64
) -> tuple[NDArray[np.uint64], bool]:
    """Signs of the NUL-separated UTF-8 values in ``buf``, value k with prefix ``prefixes[k // per]``
    (``per`` values share a prefix: one column of a slot); returns (signs, ok). ``ok`` is False
    when the piece count differs from ``n_values`` (a value contained NUL itself)."""
    out = np.empty(n_values, dtype=np.uint64)
    start = 0
    k = 0
    group = 0
    left = per  # values left under prefixes[group]
    for i in range(len(buf) + 1):
        if i == len(buf) or buf[i] == 0:
            if k >= n_values:
                return out, False
            if left == 0:
                group += 1
                left = per
            out[k] = prefixes[group] | (xxh64(buf[start:i], i - start, seed) & mask)
            left -= 1
            k += 1
            start = i + 1
    return out, k == n_values
