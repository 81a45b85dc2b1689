"""Ranking requests read straight from their JSON bytes: one compiled pass that hashes each
categorical value where it lies in the body and converts each dense value in place, with no Python
object per value (orjson builds ~8,000 of them for 200 Criteo items: 0.3 ms before any feature
work, the larger part of the decode). Three forms, the ones clients send:

    [{"<field>": v, ...}, ...]                                     a list of flat records (``scan_records``)
    {"items": [{"<item field>": v, ...}, ...], "context": {...} | null}        rows  (``scan``)
    {"items": {"<item field>": [v, ...], ...}, "context": {...} | null}        columns (``scan``)

It is a fast path, not a second parser: it accepts only a strict subset of JSON whose meaning
is unambiguous, and answers None for everything else, so that ``orjson`` and
``features.transform`` decide -- with their own errors -- every request it does not take:

- fields: the schema's slots (in a request's items: its item-scoped ones), each at most once per
  record or column, a column's arrays all of one non-zero length, at least one record or item;
- a categorical value: a string of printable ASCII without escapes, or null (""); a dense value:
  a number of at most 18 significant digits, which ``features.floats`` converts to the nearest
  double (a 17-digit ``repr`` of a double included), or null (missing); an absent field is
  missing, as in the parsed form;
- a required field present in every record (column) with no null or "" in it;
- members of a request in any order; the context: its bytes are handed to orjson (which
  validates them), so it may hold anything.

Anything else -- escapes, non-ASCII, other members (a record's label included), duplicates, ints
in a categorical field, strings in a dense one, bad JSON -- is None. The equivalence with orjson +
transform is a hypothesis test (``tests/features/test_jsonscan.py``). The lexical steps are
``features.jsonlex``'s, the reader of records (and rows) ``features.jsonrecords``'s; their loops
are compiled without reference counting (``jsonlex.uncounted``). 200 Criteo items on the 2-vCPU
VM: 0.16 ms as records, 0.13 as columns (the decode with the feature work: 0.44 and 0.40 ms, 1.1
for records through orjson + transform).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from numpy.typing import NDArray

from features.hashing import SIGN_MASK, SIGN_SEED, slot_prefixes
from features.inputs import Scanned
from features.jsonlex import (
    COLON,
    COMMA,
    LBRACE,
    LBRACKET,
    QUOTE,
    RBRACE,
    at,
    column_of,
    count_values,
    is_null,
    next_value,
    number_at,
    plain_string,
    skip_object,
    uncounted,
    word_at,
    ws,
)
from features.jsonrecords import CATEGORICAL, DENSE, _records
from features.schema import Slot
from features.xxh64 import xxh64_at

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
    """A request (rows or columns) read by the compiled pass: its item columns, and its context's
    JSON bytes (None when it has no context member); None when the body is not in the form above,
    or holds more than ``max_rows`` items (the caller's limit then answers it)."""
    buf = np.frombuffer(body, np.uint8)
    n, signs, values, c0, c1 = _scan(
        buf, table.names, table.name_off, table.kind, table.row, table.prefix, table.required,
        np.uint64(SIGN_SEED), SIGN_MASK, max_rows,
    )  # fmt: skip
    if n <= 0:
        return None
    return _scanned(n, signs, values), (body[c0:c1] if c0 >= 0 else None)


def scan_records(body: bytes, table: ScanTable, max_rows: int) -> Scanned | None:
    """A list of flat records read by the compiled pass (``table``: every slot of the schema); None
    when the body is not in the form above, or holds more than ``max_rows`` records."""
    buf = np.frombuffer(body, np.uint8)
    end, n, signs, values = _records(
        buf, ws(buf, 0), table.names, table.name_off, table.kind, table.row, table.prefix,
        table.required, np.uint64(SIGN_SEED), SIGN_MASK, max_rows,
    )  # fmt: skip
    if end < 0 or ws(buf, end) != len(buf):
        return None
    return _scanned(n, signs, values)


def _scanned(n: int, signs: NDArray[np.uint64], values: NDArray[np.float64]) -> Scanned:
    """The first ``n`` columns (records) of a scan's matrices, contiguous."""
    return Scanned(int(n), np.ascontiguousarray(signs[:, :n]), np.ascontiguousarray(values[:, :n]))


@uncounted
def _strings(buf: Any, i: int, out: Any, prefix: Any, empty: Any, required: Any, seed: Any, mask: Any) -> int:
    """i at '[': fills ``out`` with the signs of exactly len(out) strings (null: ""); the index
    of the closing bracket, or -1."""
    i = ws(buf, i + 1)
    for r in range(len(out)):
        if at(buf, i, QUOTE):
            e = plain_string(buf, i + 1)
            if e < 0 or (e == i + 1 and required):
                return -1
            out[r] = prefix | (xxh64_at(buf, i + 1, e - i - 1, seed) & mask)
            i = e + 1
        elif is_null(buf, i) and not required:
            out[r] = prefix | empty
            i += 4
        else:
            return -1
        i = next_value(buf, i, r + 1 == len(out))
        if i < 0:
            return -1
    return i


@uncounted
def _numbers(buf: Any, i: int, out: Any, required: Any) -> int:
    """i at '[': fills ``out`` with exactly len(out) numbers (null: NaN); the index of the
    closing bracket, or -1."""
    i = ws(buf, i + 1)
    for r in range(len(out)):
        if is_null(buf, i) and not required:
            out[r] = np.nan
            i += 4
        else:
            v, i = number_at(buf, i)
            if i < 0:
                return -1
            out[r] = v
        i = next_value(buf, i, r + 1 == len(out))
        if i < 0:
            return -1
    return i


@numba.njit(cache=True, nogil=True)
def _columns(buf, i, names, off, kind, row, prefix, required, seed, mask, max_rows):  # type: ignore[no-untyped-def]
    """i at '{' of a request's item columns: (index after its '}', rows, signs, values); index -1
    when they are not in the form (absent columns are filled: all "" or all missing)."""
    kc = 0
    for j in range(len(kind)):
        kc += kind[j] == CATEGORICAL
    signs = np.empty((kc, 0), np.uint64)
    values = np.empty((len(kind) - kc, 0), np.float64)
    no = (-1, 0, signs, values)
    seen = np.zeros(len(kind), np.bool_)
    empty = xxh64_at(buf, 0, 0, seed) & mask  # "" and null: the empty string's hash
    rows = -1
    i = ws(buf, i + 1)
    while True:
        if not at(buf, i, QUOTE):
            return no
        e = plain_string(buf, i + 1)
        if e < 0:
            return no
        j = column_of(buf, i + 1, e, names, off)
        if j < 0 or seen[j]:
            return no
        seen[j] = True
        i = ws(buf, e + 1)
        if not at(buf, i, COLON):
            return no
        i = ws(buf, i + 1)
        if not at(buf, i, LBRACKET):
            return no
        if rows < 0:
            rows = count_values(buf, i)
            if rows <= 0 or rows > max_rows:
                return no
            signs = np.empty((kc, rows), np.uint64)
            values = np.empty((len(kind) - kc, rows), np.float64)
        if kind[j] == CATEGORICAL:
            i = _strings(buf, i, signs[row[j]], prefix[j], empty, required[j], seed, mask)
        else:
            i = _numbers(buf, i, values[row[j]], required[j])
        if i < 0:
            return no
        i = ws(buf, i + 1)
        if at(buf, i, COMMA):
            i = ws(buf, i + 1)
        elif at(buf, i, RBRACE):
            break
        else:
            return no
    for j in range(len(kind)):  # absent columns: all "" or all missing
        if not seen[j]:
            if required[j]:
                return no
            if kind[j] == CATEGORICAL:
                signs[row[j], :] = prefix[j] | empty
            else:
                values[row[j], :] = np.nan
    return i + 1, rows, signs, values


@numba.njit(cache=True, nogil=True)
def _scan(buf, names, off, kind, row, prefix, required, seed, mask, max_rows):  # type: ignore[no-untyped-def]
    """(rows, signs, values, context start, context end); rows -1 when the body is not the fast
    form or has more than ``max_rows`` items (the context bounds are -1 when there is no context
    member). Only the first ``rows`` columns of signs and values are the request's."""
    rows = -1
    signs = np.empty((0, 0), np.uint64)
    values = np.empty((0, 0), np.float64)
    no = (-1, signs, values, -1, -1)
    c0 = c1 = -1
    i = ws(buf, 0)
    if not at(buf, i, LBRACE):
        return no
    i = ws(buf, i + 1)
    while True:  # the request's members
        if not at(buf, i, QUOTE):
            return no
        e = plain_string(buf, i + 1)
        if e < 0:
            return no
        key = buf[i + 1 : e]
        i = ws(buf, e + 1)
        if not at(buf, i, COLON):
            return no
        i = ws(buf, i + 1)
        if word_at(key, 0, _CONTEXT) and len(key) == len(_CONTEXT) and c0 < 0:
            if is_null(buf, i):
                c0, c1 = i, i + 4
            elif at(buf, i, LBRACE):
                c0, c1 = i, skip_object(buf, i)
                if c1 < 0:
                    return no
            else:
                return no
            i = c1
        elif word_at(key, 0, _ITEMS) and len(key) == len(_ITEMS) and rows < 0:
            if at(buf, i, LBRACE):
                i, rows, signs, values = _columns(
                    buf, i, names, off, kind, row, prefix, required, seed, mask, max_rows
                )
            else:
                i, rows, signs, values = _records(
                    buf, i, names, off, kind, row, prefix, required, seed, mask, max_rows
                )
            if i < 0:
                return no
        else:
            return no
        i = ws(buf, i)
        if at(buf, i, COMMA):
            i = ws(buf, i + 1)
        elif at(buf, i, RBRACE):
            break
        else:
            return no
    if ws(buf, i + 1) != len(buf) or rows < 0:
        return no
    return rows, signs, values, c0, c1
