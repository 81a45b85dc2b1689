"""The column-form ranking request read straight from its JSON bytes: one compiled pass that
hashes each categorical value where it lies in the body and converts each dense value in place,
with no Python object per value (orjson builds ~8,000 of them for 200 Criteo items: 0.23 ms
before any feature work, the larger part of the decode).

It is a fast path, not a second parser: it accepts only a strict subset of JSON whose meaning
is unambiguous, and answers None for everything else, so that ``orjson`` and
``features.transform`` decide -- with their own errors -- every request it does not take:

    {"items": {"<item field>": [v, ...], ...}, "context": {...} | null}   (members in any order)

- item fields: the schema's item-scoped categorical and dense slots, each once, every array of
  one non-zero length;
- a categorical value: a string of printable ASCII without escapes, or null (""); a dense value:
  a number of at most 18 significant digits, which ``features.floats`` converts to the nearest
  double (a 17-digit ``repr`` of a double included), or null (missing);
- a required field present with no null or "" in it;
- the context: its bytes are handed to orjson (which validates them), so it may hold anything.

Anything else -- escapes, non-ASCII, other members, duplicates, ints in a categorical column,
strings in a dense one, bad JSON -- is None. The equivalence with orjson + transform is a
hypothesis test (``tests/features/test_jsonscan.py``).

numba caches the compiled scan keyed on this file alone: after editing ``features.floats`` or
``features.xxh64`` (inlined here), delete ``features/__pycache__/*.nb[ci]`` before measuring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from numpy.typing import NDArray

from features.floats import to_float
from features.hashing import SIGN_MASK, SIGN_SEED, slot_prefixes
from features.inputs import Scanned
from features.schema import Slot
from features.xxh64 import xxh64_at

CATEGORICAL, DENSE = 0, 1
_SPACE, _TAB, _LF, _CR = 32, 9, 10, 13
_QUOTE, _BACKSLASH, _COMMA, _COLON = 34, 92, 44, 58
_LBRACE, _RBRACE, _LBRACKET, _RBRACKET = 123, 125, 91, 93
_MINUS, _PLUS, _DOT, _ZERO, _NINE = 45, 43, 46, 48, 57
_ITEMS = np.frombuffer(b"items", np.uint8)
_CONTEXT = np.frombuffer(b"context", np.uint8)


@dataclass(frozen=True)
class ScanTable:
    """The item columns a scan fills, per schema: names (concatenated bytes and offsets), each
    one's kind, its row in the signs (categorical) or values (dense) matrix, its sign prefix and
    whether it is required. Rows follow ``categorical`` and ``dense`` order, as given."""

    names: NDArray[np.uint8]
    name_off: NDArray[np.int64]
    kind: NDArray[np.int8]
    row: NDArray[np.int64]
    prefix: NDArray[np.uint64]
    required: NDArray[np.bool_]

    @classmethod
    def of(cls, categorical: tuple[Slot, ...], dense: tuple[Slot, ...]) -> ScanTable:
        slots = categorical + dense
        encoded = [s.column.encode() for s in slots]
        return cls(
            names=np.frombuffer(b"".join(encoded), np.uint8).copy(),
            name_off=np.cumsum([0] + [len(e) for e in encoded]).astype(np.int64),
            kind=np.array([CATEGORICAL] * len(categorical) + [DENSE] * len(dense), np.int8),
            row=np.array(list(range(len(categorical))) + list(range(len(dense))), np.int64),
            prefix=np.concatenate(
                [
                    slot_prefixes(np.array([s.id for s in categorical], np.int64), len(categorical)),
                    np.zeros(len(dense), np.uint64),
                ]
            ),  # fmt: skip
            required=np.array([s.required for s in slots], bool),
        )


def scan(body: bytes, table: ScanTable, max_rows: int) -> tuple[Scanned, bytes | None] | None:
    """``body`` read by the compiled pass: its item columns, and its context's JSON bytes (None when
    it has no context member); None when the body is not in the form above, or holds more than
    ``max_rows`` items (counted before anything is allocated: the caller's limit answers it)."""
    buf = np.frombuffer(body, np.uint8)
    n, signs, values, c0, c1 = _scan(
        buf, table.names, table.name_off, table.kind, table.row, table.prefix, table.required,
        np.uint64(SIGN_SEED), SIGN_MASK, max_rows,
    )  # fmt: skip
    if n <= 0:
        return None
    return Scanned(int(n), signs, values), (body[c0:c1] if c0 >= 0 else None)


# --- the kernel ----------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _skip_ws(buf: Any, i: int) -> int:
    while i < len(buf):
        c = buf[i]
        if c != _SPACE and c != _LF and c != _CR and c != _TAB:
            break
        i += 1
    return i


@numba.njit(inline="always")
def _ws(buf: Any, i: int) -> int:
    """The index of the first non-whitespace byte from i. The usual case (none) is one test
    inline; the loop is a call, which keeps the value loops small (2x faster)."""
    if i < len(buf) and buf[i] > _SPACE:
        return i
    return _skip_ws(buf, i)


@numba.njit(inline="always")
def _at(buf: Any, i: int, c: int) -> bool:
    return i < len(buf) and buf[i] == c


@numba.njit(inline="always")
def _is(buf: Any, i: int, word: Any) -> bool:
    if i + len(word) > len(buf):
        return False
    for k in range(len(word)):
        if buf[i + k] != word[k]:
            return False
    return True


@numba.njit(inline="always")
def _null(buf: Any, i: int) -> bool:
    return (
        i + 4 <= len(buf) and buf[i] == 110 and buf[i + 1] == 117 and buf[i + 2] == 108 and buf[i + 3] == 108
    )


@numba.njit(inline="always")
def _plain_string(buf: Any, i: int) -> int:
    """i just after an opening quote: the index of the closing quote of a string of printable
    ASCII without escapes, or -1."""
    while i < len(buf):
        c = buf[i]
        if c == _QUOTE:
            return i
        if c == _BACKSLASH or c < 32 or c >= 127:
            return -1
        i += 1
    return -1


@numba.njit(inline="always")
def _digit(buf: Any, i: int) -> bool:
    return i < len(buf) and _ZERO <= buf[i] <= _NINE


@numba.njit(inline="always")
def _number(buf: Any, i: int) -> tuple[float, int]:
    """(value, index after it) of the JSON number at i, or (0.0, -1) when it is not one, has more
    than 18 significant digits, or is one ``features.floats.to_float`` refuses."""
    neg = _at(buf, i, _MINUS)
    if neg:
        i += 1
    mant = 0  # every digit read, the fraction's included (may wrap past 18 digits: refused below)
    start = first = i
    while i < len(buf):
        d = int(buf[i]) - _ZERO
        if d < 0 or d > 9:
            break
        mant = mant * 10 + d
        i += 1
    read = i - start
    if read == 0 or (read > 1 and buf[start] == _ZERO):  # no digit, or a leading zero
        return 0.0, -1
    exp = 0
    integral = True
    if _at(buf, i, _DOT):
        integral = False
        i += 1
        start = i
        while i < len(buf):
            d = int(buf[i]) - _ZERO
            if d < 0 or d > 9:
                break
            mant = mant * 10 + d
            i += 1
        if i == start:
            return 0.0, -1
        exp = start - i
        read += i - start
    if _at(buf, i, 101) or _at(buf, i, 69):  # e, E
        integral = False
        i += 1
        eneg = _at(buf, i, _MINUS)
        if eneg or _at(buf, i, _PLUS):
            i += 1
        e = 0
        start = i
        while i < len(buf):
            d = int(buf[i]) - _ZERO
            if d < 0 or d > 9:
                break
            if e < 100_000:
                e = e * 10 + d
            i += 1
        if i == start:
            return 0.0, -1
        exp += -e if eneg else e
    if read > 18:  # mant has wrapped unless leading zeros (0.000...) make up the difference
        zeros = 0
        while first < i and (buf[first] == _ZERO or buf[first] == _DOT):
            zeros += buf[first] == _ZERO
            first += 1
        if read - zeros > 18:
            return 0.0, -1
    # orjson reads "-0" as the int 0, "-0.0" and "-0e0" as the float -0.0
    v, ok = to_float(np.uint64(mant), exp, neg and not (integral and mant == 0))
    return (v, i) if ok else (0.0, -1)


@numba.njit(inline="always")
def _string_end(buf: Any, i: int) -> int:
    """i just after an opening quote: the index of its closing quote, escapes skipped (len(buf)
    or beyond when there is none)."""
    while i < len(buf) and buf[i] != _QUOTE:
        i += 2 if buf[i] == _BACKSLASH else 1
    return i


@numba.njit(cache=True, nogil=True)
def _skip_object(buf: Any, i: int) -> int:
    """i at '{': the index after its matching '}' by bracket depth (strings skipped with their
    escapes), or -1. Not a validator: orjson validates the bytes it spans."""
    depth = 0
    while i < len(buf):
        c = buf[i]
        if c == _QUOTE:
            i = _string_end(buf, i + 1)
        elif c == _LBRACE or c == _LBRACKET:
            depth += 1
        elif c == _RBRACE or c == _RBRACKET:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


@numba.njit(cache=True, nogil=True)
def _count(buf: Any, i: int) -> int:
    """i at '[' of an array of scalars: its element count (commas + 1), 0 when empty, -1 when it
    nests or does not end."""
    i = _ws(buf, i + 1)
    if _at(buf, i, _RBRACKET):
        return 0
    n = 1
    while i < len(buf):
        c = buf[i]
        if c == _QUOTE:
            i = _string_end(buf, i + 1)
        elif c == _COMMA:
            n += 1
        elif c == _RBRACKET:
            return n
        elif c == _LBRACE or c == _LBRACKET:
            return -1
        i += 1
    return -1


@numba.njit(cache=True, nogil=True)
def _column(buf: Any, name_start: int, name_end: int, names: Any, off: Any) -> int:
    m = name_end - name_start
    for j in range(len(off) - 1):
        if off[j + 1] - off[j] == m:
            same = True
            for k in range(m):
                if names[off[j] + k] != buf[name_start + k]:
                    same = False
                    break
            if same:
                return j
    return -1


@numba.njit(inline="always")
def _next(buf: Any, i: int, last: bool) -> int:
    """i after an array's value: the next value's index (after a comma) when more are due, the
    closing bracket's index after the ``last`` one; -1 otherwise (too few, too many, not JSON)."""
    if not last and _at(buf, i, _COMMA):  # the usual case, first (2x faster than _ws first)
        return _ws(buf, i + 1)
    i = _ws(buf, i)
    if last:
        return i if _at(buf, i, _RBRACKET) else -1
    return _ws(buf, i + 1) if _at(buf, i, _COMMA) else -1


@numba.njit(inline="always")
def _strings(buf, i, out, prefix, empty, required, seed, mask):  # type: ignore[no-untyped-def]
    """i at '[': fills ``out`` with the signs of exactly len(out) strings (null: ""); the index
    of the closing bracket, or -1."""
    i = _ws(buf, i + 1)
    for r in range(len(out)):
        if _at(buf, i, _QUOTE):
            e = _plain_string(buf, i + 1)
            if e < 0 or (e == i + 1 and required):
                return -1
            out[r] = prefix | (xxh64_at(buf, i + 1, e - i - 1, seed) & mask)
            i = e + 1
        elif _null(buf, i) and not required:
            out[r] = prefix | empty
            i += 4
        else:
            return -1
        i = _next(buf, i, r + 1 == len(out))
        if i < 0:
            return -1
    return i


@numba.njit(inline="always")
def _numbers(buf, i, out, required):  # type: ignore[no-untyped-def]
    """i at '[': fills ``out`` with exactly len(out) numbers (null: NaN); the index of the
    closing bracket, or -1."""
    i = _ws(buf, i + 1)
    for r in range(len(out)):
        if _null(buf, i) and not required:
            out[r] = np.nan
            i += 4
        else:
            v, i = _number(buf, i)
            if i < 0:
                return -1
            out[r] = v
        i = _next(buf, i, r + 1 == len(out))
        if i < 0:
            return -1
    return i


@numba.njit(cache=True, nogil=True)
def _scan(buf, names, off, kind, row, prefix, required, seed, mask, max_rows):  # type: ignore[no-untyped-def]
    """(rows, signs, values, context start, context end); rows -1 when the body is not the fast
    form or has more than ``max_rows`` items (the context bounds are -1 when there is no context
    member)."""
    kc = 0
    for j in range(len(kind)):
        kc += kind[j] == CATEGORICAL
    kd = len(kind) - kc
    signs = np.empty((kc, 0), np.uint64)
    values = np.empty((kd, 0), np.float64)
    no = (-1, signs, values, -1, -1)
    seen = np.zeros(len(kind), np.bool_)
    empty = xxh64_at(buf, 0, 0, seed) & mask  # "" and null: the empty string's hash
    rows = -1
    c0 = c1 = -1
    items = False
    i = _ws(buf, 0)
    if not _at(buf, i, _LBRACE):
        return no
    i = _ws(buf, i + 1)
    while True:  # the request's members
        if not _at(buf, i, _QUOTE):
            return no
        e = _plain_string(buf, i + 1)
        if e < 0:
            return no
        key = buf[i + 1 : e]
        i = _ws(buf, e + 1)
        if not _at(buf, i, _COLON):
            return no
        i = _ws(buf, i + 1)
        if _is(key, 0, _CONTEXT) and len(key) == len(_CONTEXT) and c0 < 0:
            if _null(buf, i):
                c0, c1 = i, i + 4
            elif _at(buf, i, _LBRACE):
                c0, c1 = i, _skip_object(buf, i)
                if c1 < 0:
                    return no
            else:
                return no
            i = c1
        elif _is(key, 0, _ITEMS) and len(key) == len(_ITEMS) and not items:
            items = True
            if not _at(buf, i, _LBRACE):
                return no
            i = _ws(buf, i + 1)
            while True:  # the item columns
                if not _at(buf, i, _QUOTE):
                    return no
                e = _plain_string(buf, i + 1)
                if e < 0:
                    return no
                j = _column(buf, i + 1, e, names, off)
                if j < 0 or seen[j]:
                    return no
                seen[j] = True
                i = _ws(buf, e + 1)
                if not _at(buf, i, _COLON):
                    return no
                i = _ws(buf, i + 1)
                if not _at(buf, i, _LBRACKET):
                    return no
                if rows < 0:
                    rows = _count(buf, i)
                    if rows <= 0 or rows > max_rows:
                        return no
                    signs = np.empty((kc, rows), np.uint64)
                    values = np.empty((kd, rows), np.float64)
                if kind[j] == CATEGORICAL:
                    i = _strings(buf, i, signs[row[j]], prefix[j], empty, required[j], seed, mask)
                else:
                    i = _numbers(buf, i, values[row[j]], required[j])
                if i < 0:
                    return no
                i = _ws(buf, i + 1)
                if _at(buf, i, _COMMA):
                    i = _ws(buf, i + 1)
                elif _at(buf, i, _RBRACE):
                    break
                else:
                    return no
            i += 1
        else:
            return no
        i = _ws(buf, i)
        if _at(buf, i, _COMMA):
            i = _ws(buf, i + 1)
        elif _at(buf, i, _RBRACE):
            break
        else:
            return no
    if _ws(buf, i + 1) != len(buf) or not items:
        return no
    for j in range(len(kind)):  # absent columns: all "" or all missing
        if not seen[j]:
            if required[j]:
                return no
            if kind[j] == CATEGORICAL:
                signs[row[j], :] = prefix[j] | empty
            else:
                values[row[j], :] = np.nan
    return rows, signs, values, c0, c1
