"""Flat records read straight from JSON bytes, for ``features.jsonscan``: a list of records, or a
ranking request's items in rows -- ``[{"<field>": v, ...}, ...]`` -- into the signs of the
categorical fields and the values of the dense ones, one column per record (the form and what is
taken are in ``features.jsonscan``'s docstring; the lexical steps are ``features.jsonlex``'s).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from features.jsonlex import (
    COLON,
    COMMA,
    LBRACE,
    LBRACKET,
    QUOTE,
    RBRACE,
    RBRACKET,
    at,
    is_null,
    name_end,
    number_at,
    plain_string,
    uncounted,
    ws,
)
from features.xxh64 import xxh64_at

CATEGORICAL, DENSE = 0, 1
"""A field's kind in a ``ScanTable``."""


@numba.njit(cache=True, nogil=True)
def _records(buf, i, names, off, kind, row, prefix, required, seed, mask, max_rows):  # type: ignore[no-untyped-def]
    """i at '[' of flat records: (index after its ']', records, signs, values) with room for more
    columns than records (the caller takes the first ``records``); index -1 when they are not in
    the form. Allocates and grows; ``_fill`` reads."""
    kc = 0
    for j in range(len(kind)):
        kc += kind[j] == CATEGORICAL
    cap = 256
    signs = np.empty((kc, cap), np.uint64)
    values = np.empty((len(kind) - kc, cap), np.float64)
    no = (-1, 0, signs, values)
    if not at(buf, i, LBRACKET):
        return no
    seen = np.zeros(len(kind), np.bool_)
    empty = xxh64_at(buf, 0, 0, seed) & mask  # "" and null: the empty string's hash
    n = guess = 0
    i = ws(buf, i + 1)
    while True:
        done, i, n, guess = _fill(
            buf, i, names, off, kind, row, prefix, required, seed, mask, empty, signs, values, seen, n, guess,
            max_rows,
        )  # fmt: skip
        if i < 0:
            return no
        if done:
            return i, n, signs, values
        cap *= 4  # full: room for four times as many
        grown_s = np.empty((kc, cap), np.uint64)
        grown_s[:, :n] = signs[:, :n]
        grown_v = np.empty((len(kind) - kc, cap), np.float64)
        grown_v[:, :n] = values[:, :n]
        signs, values = grown_s, grown_v


@uncounted
def _fill(
    buf: Any,
    i: int,
    names: Any,
    off: Any,
    kind: Any,
    row: Any,
    prefix: Any,
    required: Any,
    seed: Any,
    mask: Any,
    empty: Any,
    signs: Any,
    values: Any,
    seen: Any,
    n: int,
    guess: int,
    max_rows: int,
) -> tuple[bool, int, int, int]:
    """i at a record's '{': reads records into column ``n`` on of ``signs`` and ``values`` until
    the list ends (done, the index after its ']') or they are full (not done, the index of the next
    record); (done, -1, ...) when not in the form. A field's name is looked for from the one after
    the previous field's (``guess``): records that list their fields in one order (missing ones
    left out) find each in a test or two. Compiled without reference counting: the arrays are the
    caller's, and counting references to them costs more than the read (8x)."""
    while n < signs.shape[1]:  # (slots, capacity), also with no categorical slot
        if not at(buf, i, LBRACE) or n >= max_rows:
            return False, -1, n, guess
        for k in range(len(seen)):
            seen[k] = False
        i = ws(buf, i + 1)
        while not at(buf, i, RBRACE):  # its fields
            if not at(buf, i, QUOTE):
                return False, -1, n, guess
            j = e = -1
            for k in range(len(kind)):
                c = guess + k if guess + k < len(kind) else guess + k - len(kind)
                e = name_end(buf, i + 1, names, off, c)
                if e >= 0:
                    j = c
                    break
            if j < 0 or seen[j]:  # not a field (or not spelled plainly: orjson decides), or a duplicate
                return False, -1, n, guess
            seen[j] = True
            guess = j + 1 if j + 1 < len(kind) else 0
            i = ws(buf, e + 1)
            if not at(buf, i, COLON):
                return False, -1, n, guess
            i = ws(buf, i + 1)
            if kind[j] == CATEGORICAL:
                if at(buf, i, QUOTE):
                    e = plain_string(buf, i + 1)
                    if e < 0 or (e == i + 1 and required[j]):
                        return False, -1, n, guess
                    signs[row[j], n] = prefix[j] | (xxh64_at(buf, i + 1, e - i - 1, seed) & mask)
                    i = e + 1
                elif is_null(buf, i) and not required[j]:
                    signs[row[j], n] = prefix[j] | empty
                    i += 4
                else:
                    return False, -1, n, guess
            elif is_null(buf, i) and not required[j]:
                values[row[j], n] = np.nan
                i += 4
            else:
                v, i = number_at(buf, i)
                if i < 0:
                    return False, -1, n, guess
                values[row[j], n] = v
            i = ws(buf, i)
            if at(buf, i, COMMA):
                i = ws(buf, i + 1)
                if at(buf, i, RBRACE):  # a trailing comma
                    return False, -1, n, guess
            elif not at(buf, i, RBRACE):
                return False, -1, n, guess
        for j in range(len(kind)):  # absent fields: "" or missing
            if not seen[j]:
                if required[j]:
                    return False, -1, n, guess
                if kind[j] == CATEGORICAL:
                    signs[row[j], n] = prefix[j] | empty
                else:
                    values[row[j], n] = np.nan
        n += 1
        i = ws(buf, i + 1)
        if at(buf, i, COMMA):
            i = ws(buf, i + 1)
        elif at(buf, i, RBRACKET):
            return True, i + 1, n, guess
        else:
            return False, -1, n, guess
    return False, i, n, guess
