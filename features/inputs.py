"""What ``transform`` accepts, checked against the schema and seen through one view (``Input``):

- a ``Table`` (columns of strings, as ``features.stream`` reads files);
- a list of flat records ``[{"C1": "05db9164", "I1": 3, ...}, ...]`` (one per row);
- a ranking request ``{"context": {...}, "items": [{...}, ...]}``: context-scoped features once,
  item-scoped features per item. Such a batch stores its context slots once;
- the same request in column form, ``{"context": {...}, "items": {"C1": [v, ...], "I1": [...]}}``:
  each item field's values as one array (missing: absent, or null). orjson parses it straight into
  the columns ``transform`` works on, with no pass over the items in Python: the fast form for
  clients. ``features.jsonscan`` reads these forms straight from their bytes (``Scanned``) when it can.

Unknown fields, a field sent in the wrong part of a request, a missing required value and
columns of unequal length are refused here, with a ``FeatureError`` naming the field.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from features.schema import Schema, Slot

Record = dict[str, Any]  # one row, or a request's context: JSON values by field name
Column = list[Any] | NDArray[Any]  # one field's values, one per stored row


class FeatureError(ValueError):
    """Records that do not fit the schema; the message names the field and the problem."""


@dataclass
class Table:
    """Columns of equal length (numpy arrays), e.g. from a file reader. Missing values are ""."""

    columns: dict[str, NDArray[Any]]
    num_rows: int


@dataclass(frozen=True)
class Scanned:
    """A JSON body's per-row fields as ``features.jsonscan`` read them from its bytes (a request's
    items, or a list of records): the signs of the categorical slots and the raw values of the
    dense slots stored per row (NaN: missing), each (slots, rows) in ``transform``'s slot order."""

    num_rows: int
    signs: NDArray[np.uint64]
    values: NDArray[np.float64]


@dataclass
class Input:
    """Checked records, whatever form they came in."""

    num_rows: int
    has_context: bool
    items: list[Record] | dict[str, list[Any]] | Table | Scanned  # records, columns, a Table, or scanned
    context: Record = field(default_factory=dict)  # a request's context (empty for rows)

    def stored_once(self, scope: str) -> bool:
        return scope == "context" and self.has_context

    def columns(self, slots: list[Slot], once: bool, missing: object) -> list[Column]:
        """One list/array per slot: its values for every stored row (1 row if ``once``)."""
        if once:
            return [[self.context.get(s.column, missing)] for s in slots]
        if isinstance(self.items, Scanned):  # transform takes its arrays as they are
            raise TypeError("a scanned request's item columns are its signs and values")
        if isinstance(self.items, Table):
            blank = np.full(self.num_rows, "", np.str_)
            return [self.items.columns.get(s.column, blank) for s in slots]
        if isinstance(self.items, dict):  # the column form: each column's values as sent
            absent = [missing] * self.num_rows
            return [self.items.get(s.column, absent) for s in slots]
        # map(dict.get, ...) runs the loop in C: ~3x faster than a comprehension
        return [
            list(map(dict.get, self.items, itertools.repeat(s.column), itertools.repeat(missing)))
            for s in slots
        ]


def normalise(records: object, schema: Schema) -> Input:
    """``records`` in any accepted form, checked, as an ``Input``; a FeatureError otherwise."""
    if isinstance(records, Table):
        return Input(records.num_rows, False, records)
    if isinstance(records, Mapping):
        if set(records) - {"context", "items"} or "items" not in records:
            raise FeatureError('a request is {"context": {...}, "items": [{...}, ...]} or a list of records')
        items, context = records["items"], records.get("context", {})
        if isinstance(items, dict):  # the column form: {"C1": [v, ...], "I1": [...], ...}
            n = _check_columns(items, schema)
            return Input(n, True, items, check_context(context, schema))
        if not isinstance(items, list) or not items:
            raise FeatureError(
                '"items" must be a non-empty list of objects, or an object of equal-length arrays'
            )
        _check_fields(items, schema, "item", allow_label=False)
        return Input(len(items), True, items, check_context(context, schema))
    if isinstance(records, list):
        if not records:
            raise FeatureError("no records")
        _check_fields(records, schema, None, allow_label=True)
        return Input(len(records), False, records)
    raise FeatureError(
        f"records must be a request object, a list of records or a Table, not {type(records).__name__}"
    )


def check_context(context: object, schema: Schema) -> Record:
    """A request's context as sent (null: none), checked: an object of known context fields."""
    context = {} if context is None else context
    if not isinstance(context, dict):
        raise FeatureError('"context" must be an object')
    _check_fields([context], schema, "context", allow_label=False)
    return context


def _check_columns(items: dict[str, Any], schema: Schema) -> int:
    """The item count of a column-form request, after checking it: known item fields only, each an
    array, all of one non-zero length, required ones present with no missing value."""
    allowed = {s.column for s in schema.slots if s.scope == "item"}
    unknown = set(items) - allowed
    if unknown:
        hint = (
            " (sent in the wrong part of the request)" if {s.column for s in schema.slots} & unknown else ""
        )
        raise FeatureError(f"unknown field(s) in items: {sorted(map(str, unknown))[:5]}{hint}")
    if not items:
        raise FeatureError('"items" has no columns')
    lengths = {len(v) if isinstance(v, list) else -1 for v in items.values()}
    if -1 in lengths:
        bad = next(k for k, v in items.items() if not isinstance(v, list))
        raise FeatureError(f"items column {bad!r} must be an array (one value per item)")
    if len(lengths) != 1 or 0 in lengths:
        raise FeatureError(
            f"items columns must all have the same non-zero length, got lengths {sorted(lengths)}"
        )
    for s in schema.slots:
        if s.required and s.scope == "item":
            col = items.get(s.column)
            if col is None or None in col or "" in col:
                raise FeatureError(f"required field {s.column!r} is missing")
    return lengths.pop()


def _check_fields(records: list[Any], schema: Schema, scope: str | None, allow_label: bool) -> None:
    """``records`` (as parsed, unchecked) are objects of known fields in ``scope`` (None: any),
    the required ones present and not empty."""
    if not all(isinstance(r, dict) for r in records):
        raise FeatureError("every record/item must be a JSON object")
    allowed = {s.column for s in schema.slots if scope is None or s.scope == scope}
    if allow_label and schema.label:
        allowed.add(schema.label)
    unknown = set().union(*records) - allowed
    if unknown:
        where = f" in {scope}" if scope else ""
        hint = (
            " (sent in the wrong part of the request)" if {s.column for s in schema.slots} & unknown else ""
        )
        raise FeatureError(f"unknown field(s){where}: {sorted(map(str, unknown))[:5]}{hint}")
    for s in schema.slots:
        if s.required and (scope is None or s.scope == scope):
            col = list(map(dict.get, records, itertools.repeat(s.column)))
            if None in col or "" in col:
                raise FeatureError(f"required field {s.column!r} is missing")
