"""The lexical steps of ``features.jsonscan``'s compiled passes over JSON bytes: whitespace,
plain strings, numbers (``features.floats``), null, and skipping or counting what a scan does not
read value by value; field names (``name_end``). Each takes the body (a uint8 array) and an index,
and answers an index (-1: not the strict form the scans take; the caller then leaves the body to
orjson).

numba inlines these into the scans and caches those keyed on their own files: after editing this
file, ``features.floats`` or ``features.xxh64``, delete ``features/__pycache__/*.nb[ci]`` before
measuring.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import numba
import numpy as np

from features.floats import to_float

_SPACE, _TAB, _LF, _CR = 32, 9, 10, 13
QUOTE, _BACKSLASH, COMMA, COLON = 34, 92, 44, 58
LBRACE, RBRACE, LBRACKET, RBRACKET = 123, 125, 91, 93
_MINUS, _PLUS, _DOT, _ZERO = 45, 43, 46, 48
_F = TypeVar("_F", bound=Callable[..., Any])


def uncounted(fn: _F) -> _F:
    """``numba.njit`` (cached, without the GIL) compiled without reference counting, for a scan's
    loops over arrays its caller owns: numba counts references to an array at every call and
    inlined step that takes it, and in a loop those atomic counts cost more than the read itself
    (a records scan took 8x as long). Such a function allocates nothing."""
    return numba.njit(cache=True, nogil=True, _nrt=False)(fn)  # type: ignore[call-overload,no-any-return]


@numba.njit(cache=True, nogil=True)
def skip_ws(buf: Any, i: int) -> int:
    while i < len(buf):
        c = buf[i]
        if c != _SPACE and c != _LF and c != _CR and c != _TAB:
            break
        i += 1
    return i


@numba.njit(inline="always")
def ws(buf: Any, i: int) -> int:
    """The index of the first non-whitespace byte from i. The usual case (none) is one test
    inline; the loop is a call, which keeps the value loops small (2x faster)."""
    if i < len(buf) and buf[i] > _SPACE:
        return i
    return skip_ws(buf, i)


@numba.njit(inline="always")
def at(buf: Any, i: int, c: int) -> bool:
    return i < len(buf) and buf[i] == c


@numba.njit(inline="always")
def word_at(buf: Any, i: int, word: Any) -> bool:
    if i + len(word) > len(buf):
        return False
    for k in range(len(word)):
        if buf[i + k] != word[k]:
            return False
    return True


@numba.njit(inline="always")
def is_null(buf: Any, i: int) -> bool:
    return (
        i + 4 <= len(buf) and buf[i] == 110 and buf[i + 1] == 117 and buf[i + 2] == 108 and buf[i + 3] == 108
    )


@numba.njit(inline="always")
def plain_string(buf: Any, i: int) -> int:
    """i just after an opening quote: the index of the closing quote of a string of printable
    ASCII without escapes, or -1."""
    while i < len(buf):
        c = buf[i]
        if c == QUOTE:
            return i
        if c == _BACKSLASH or c < 32 or c >= 127:
            return -1
        i += 1
    return -1


@numba.njit(inline="always")
def number_at(buf: Any, i: int) -> tuple[float, int]:
    """(value, index after it) of the JSON number at i, or (0.0, -1) when it is not one, has more
    than 18 significant digits, or is one ``features.floats.to_float`` refuses."""
    neg = at(buf, i, _MINUS)
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
    if at(buf, i, _DOT):
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
    if at(buf, i, 101) or at(buf, i, 69):  # e, E
        integral = False
        i += 1
        eneg = at(buf, i, _MINUS)
        if eneg or at(buf, i, _PLUS):
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
def string_end(buf: Any, i: int) -> int:
    """i just after an opening quote: the index of its closing quote, escapes skipped (len(buf)
    or beyond when there is none)."""
    while i < len(buf) and buf[i] != QUOTE:
        i += 2 if buf[i] == _BACKSLASH else 1
    return i


@numba.njit(cache=True, nogil=True)
def skip_object(buf: Any, i: int) -> int:
    """i at '{': the index after its matching '}' by bracket depth (strings skipped with their
    escapes), or -1. Not a validator: orjson validates the bytes it spans."""
    depth = 0
    while i < len(buf):
        c = buf[i]
        if c == QUOTE:
            i = string_end(buf, i + 1)
        elif c == LBRACE or c == LBRACKET:
            depth += 1
        elif c == RBRACE or c == RBRACKET:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


@numba.njit(cache=True, nogil=True)
def count_values(buf: Any, i: int) -> int:
    """i at '[' of an array of scalars: its element count (commas + 1), 0 when empty, -1 when it
    nests or does not end."""
    i = ws(buf, i + 1)
    if at(buf, i, RBRACKET):
        return 0
    n = 1
    while i < len(buf):
        c = buf[i]
        if c == QUOTE:
            i = string_end(buf, i + 1)
        elif c == COMMA:
            n += 1
        elif c == RBRACKET:
            return n
        elif c == LBRACE or c == LBRACKET:
            return -1
        i += 1
    return -1


@numba.njit(cache=True, nogil=True)
def column_of(buf: Any, name_start: int, name_end: int, names: Any, off: Any) -> int:
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
def next_value(buf: Any, i: int, last: bool) -> int:
    """i after an array's value: the next value's index (after a comma) when more are due, the
    closing bracket's index after the ``last`` one; -1 otherwise (too few, too many, not JSON)."""
    if not last and at(buf, i, COMMA):  # the usual case, first (2x faster than _ws first)
        return ws(buf, i + 1)
    i = ws(buf, i)
    if last:
        return i if at(buf, i, RBRACKET) else -1
    return ws(buf, i + 1) if at(buf, i, COMMA) else -1


@numba.njit(inline="always")
def name_end(buf: Any, start: int, names: Any, off: Any, j: int) -> int:
    """The index of the closing quote when the string at ``start`` is column j's name, else -1."""
    end: int = start + off[j + 1] - off[j]
    if end >= len(buf) or buf[end] != QUOTE:
        return -1
    for k in range(end - start):
        if names[off[j] + k] != buf[start + k]:
            return -1
    return end
