"""Stable 64-bit signs for categorical values, and the routing of signs to shards.

``sign(slot, value)`` is the contract between training and serving, so it is defined here once
and pinned by a table of known values in the tests:

    h    = XXH64(utf8(value), seed=SIGN_SEED)                  # the reference xxHash, 64-bit
    sign = (slot_id << SIGN_BITS) | (h & (2**SIGN_BITS - 1))   # slot_id in the top 16 bits

The slot id lives in the top bits, so equal strings in different slots can never collide; within
a slot, 48 hash bits leave ~0.2% chance of one collision among a million values. Python's
``hash()`` is never used (it is salted per process).

Routing (``shard_of``) mixes all 64 bits with the splitmix64 finaliser before the modulo, so the
slot prefix does not skew shards. Every component that routes signs calls this one function.

Routing and the set operations on signs are numpy; the compiled XXH64 that hashes strings lives in
``features.xxh64`` and is imported on first use, so a process that only routes signs (a serving
PS shard) does not load numba.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

SIGN_SEED = 0x7265637365727665  # b"recserve" as a big-endian integer
SIGN_BITS = 48
SLOT_BITS = 16
MAX_SLOT_ID = (1 << SLOT_BITS) - 1
SIGN_MASK = np.uint64((1 << SIGN_BITS) - 1)
SLOT_SHIFT = np.uint64(SIGN_BITS)
"""``sign >> SLOT_SHIFT`` is the sign's slot id."""


SlotIds = int | NDArray[np.integer]  # one slot id for all values, or one per value


def slot_prefixes(slot_id: SlotIds, n: int) -> NDArray[np.uint64]:
    """``slot_id << SIGN_BITS`` for one slot id, or for each of n (checked): a sign's top bits."""
    ids = np.atleast_1d(np.asarray(slot_id, dtype=np.int64))
    if ids.size and (ids.min() < 1 or ids.max() > MAX_SLOT_ID):
        raise ValueError(f"slot ids must be in 1..{MAX_SLOT_ID}")
    if len(ids) not in (1, n):
        raise ValueError("need one slot id, or one per value")
    return ids.astype(np.uint64) << np.uint64(SIGN_BITS)


def hash_str_list(values: list[str], slot_id: SlotIds) -> NDArray[np.uint64]:
    """``hash_values`` for a Python list of str: one join + one UTF-8 encode + one compiled pass
    (several times faster than building a numpy string array first)."""
    prefixes = slot_prefixes(slot_id, len(values))
    if values:
        try:
            text = "\0".join(values)
        except TypeError:  # not all str
            raise ValueError("hash_str_list needs a list of str") from None
        out = _hash_text(text, len(values), prefixes, 1 if len(prefixes) > 1 else len(values))
        if out is not None:
            return out
    return hash_values(np.array(values, dtype=np.str_), slot_id)


def hash_str_columns(columns: list[list[str]], slot_ids: list[int]) -> NDArray[np.uint64]:
    """``hash_str_list`` of equal-length columns of str, column j in slot ``slot_ids[j]``: the
    signs column after column. ValueError when a value is not a str, or contains NUL."""
    m = len(columns[0]) if columns else 0
    if len(columns) != len(slot_ids) or any(len(c) != m for c in columns):
        raise ValueError("hash_str_columns needs one slot id per column and columns of one length")
    if not m:
        return np.empty(0, np.uint64)
    try:
        text = "\0".join(map("\0".join, columns))
    except TypeError:
        raise ValueError("hash_str_columns needs columns of str") from None
    out = _hash_text(text, m * len(columns), slot_prefixes(np.asarray(slot_ids, np.int64), len(slot_ids)), m)
    if out is None:
        raise ValueError("a value contains NUL")
    return out


def _hash_text(text: str, n: int, prefixes: NDArray[np.uint64], per: int) -> NDArray[np.uint64] | None:
    """Signs of the n NUL-joined values of ``text``; None when a value held a NUL of its own."""
    from features.xxh64 import hash_joined

    buf = np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8)
    out, ok = hash_joined(buf, n, np.uint64(SIGN_SEED), prefixes, per, SIGN_MASK)
    return out if ok else None


def xxh64_strings(values: NDArray[np.str_], seed: int = SIGN_SEED) -> NDArray[np.uint64]:
    """Plain XXH64 (64 bits, no slot prefix) of each string of a numpy 'U' array."""
    from features.xxh64 import hash_codepoints

    u = _as_unicode(values)
    return hash_codepoints(
        _codepoints(u), np.uint64(seed), np.zeros(1, np.uint64), np.uint64(0xFFFFFFFFFFFFFFFF)
    )


def hash_values(values: NDArray[np.str_], slot_id: SlotIds) -> NDArray[np.uint64]:
    """Signs (uint64) of string values, in one compiled pass. ``slot_id``: one id for all values,
    or one id per value (to hash several slots' columns in one call)."""
    u = _as_unicode(values)
    prefixes = slot_prefixes(slot_id, len(u))
    from features.xxh64 import hash_codepoints

    return hash_codepoints(_codepoints(u), np.uint64(SIGN_SEED), prefixes, SIGN_MASK)


def sign(slot_id: int, value: str) -> int:
    """The sign of one value (for tests, docs and debugging; hot paths use ``hash_values``)."""
    return int(hash_values(np.array([value]), slot_id)[0])


def _as_unicode(values: NDArray[np.str_]) -> NDArray[np.str_]:
    u = np.asarray(values)
    if u.dtype.kind != "U":
        u = u.astype(np.str_)
    if u.ndim != 1:
        u = u.reshape(-1)
    return np.ascontiguousarray(u)


def _codepoints(u: NDArray[np.str_]) -> NDArray[np.uint32]:
    width = max(u.dtype.itemsize // 4, 1)
    if u.dtype.itemsize == 0:  # an array of empty strings has itemsize 0
        return np.zeros((len(u), 1), dtype=np.uint32)
    return u.view(np.uint32).reshape(len(u), width)


TABLE_SALT = np.uint64(0x5DEECE66DA3B9F17)
"""Salt of the hash that places a sign inside one PS shard: ``mix64(sign ^ TABLE_SALT)``, whose
high bits pick a full dump's bucket (``model_store.shards.table_hash``) and a sign's home slot in
the PS's in-memory index and admission sketch (``serving.ps.index``, compiled). Routing uses the
unsalted ``mix64``, so within one shard its low bits follow the shard number; the salt keeps the
placement uniform."""


def mix64(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """splitmix64 finaliser, vectorised over a uint64 array (wrapping arithmetic)."""
    z = np.asarray(x, dtype=np.uint64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def cross_signs(a: NDArray[np.uint64], b: NDArray[np.uint64], slot_id: int) -> NDArray[np.uint64]:
    """Signs of the cross of two sign columns (element-wise), in slot ``slot_id``."""
    h = mix64(mix64(a) ^ (b * np.uint64(0x9E3779B97F4A7C15)))
    return np.uint64(slot_id << SIGN_BITS) | (h & SIGN_MASK)


def shard_of(signs: NDArray[np.uint64], num_shards: int) -> NDArray[np.int64]:
    """The shard (0..num_shards-1) that owns each sign. The one routing function of recserve."""
    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    return (mix64(signs) % np.uint64(num_shards)).astype(np.int64)


def unique_signs(signs: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """The distinct signs, sorted: ``np.unique`` by one sort. (numpy 2.4's plain ``np.unique`` takes
    a hash-table path that is 25-60x slower on millions of uint64: 5.2 s vs 0.08 s for 5M.)"""
    s = np.sort(np.asarray(signs, dtype=np.uint64).reshape(-1))
    if len(s) < 2:
        return s
    keep = np.empty(len(s), dtype=np.bool_)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def has_duplicates(signs: NDArray[np.uint64]) -> bool:
    s = np.sort(np.asarray(signs).reshape(-1))
    return bool(len(s) > 1 and (s[1:] == s[:-1]).any())
