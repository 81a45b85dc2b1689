"""Typed, versioned JSON records of the model store: one decoder for the version manifest
(``model_store.manifest.VersionManifest``) and a shard's meta.json (``model_store.meta.ShardMeta``).

A record is a dataclass with a ``format`` field. ``decode`` builds it from the parsed JSON and
refuses, with a ``RecordError`` naming the record and the file: another ``format``
(``UnknownFormat``), a missing required field, an unknown field, or a value of the wrong JSON type.
Nested dataclass fields (and ``X | None`` of one) are decoded the same way; other values are taken
as they are after their outer JSON type is checked (``dict``, ``list``, ``str``, numbers, bool).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar, cast

from model_store.errors import RecordError, UnknownFormat

T = TypeVar("T")


@functools.cache
def _hints(cls: Any) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _options(tp: Any) -> tuple[Any, ...]:
    """The alternatives of ``A | B`` (one element for a plain type)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def _matches(value: Any, tp: Any, origin: Any) -> bool:
    """Whether JSON ``value`` fits type ``tp`` (``origin``: its ``typing.get_origin`` or itself)."""
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(origin, type) and dataclasses.is_dataclass(origin):
        return isinstance(value, dict)
    return isinstance(origin, type) and isinstance(value, origin)


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    required: bool
    hint: Any
    options: tuple[tuple[Any, Any], ...]  # (type, its origin) of each alternative
    record: Any  # the dataclass among the options, if any
    to_float: bool  # an int where a float is wanted becomes one


@functools.cache
def _plan(cls: Any) -> tuple[tuple[_Field, ...], frozenset[str], Any]:
    """The fields of ``cls`` as ``decode`` reads them, worked out once a class: (fields, names, the
    ``format`` default or MISSING). A delta's every shard meta is decoded by every process that
    applies it; introspecting the type hints per record was a third of reading one."""
    hints = _hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        options = _options(hints[f.name])
        record = next((t for t in options if isinstance(t, type) and dataclasses.is_dataclass(t)), None)
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        origins = tuple((t, typing.get_origin(t) or t) for t in options)
        fields.append(_Field(f.name, required, hints[f.name], origins, record, float in options))
    fmt = next((f.default for f in dataclasses.fields(cls) if f.name == "format"), dataclasses.MISSING)
    return tuple(fields), frozenset(f.name for f in fields), fmt


def decode(cls: type[T], raw: object, what: str, where: str, formats: tuple[Any, ...] = ()) -> T:
    """``cls`` from the parsed JSON ``raw`` of the ``what`` record in ``where``; ``formats``: the
    ``format`` values this release reads (default: ``cls``'s own)."""
    if not isinstance(raw, dict):
        raise RecordError(f"{where}: a {what} is a JSON object, found {type(raw).__name__}")
    fields, names, fmt = _plan(cast(Any, cls))
    if "format" in names:
        known = formats or (fmt,)
        if raw.get("format") not in known:
            raise UnknownFormat(
                f"{where}: {what} format {raw.get('format')!r}; this recserve reads format "
                f"{' or '.join(map(repr, known))} (written by another recserve release?)"
            )
    unknown = sorted(set(raw) - names)
    if unknown:
        raise RecordError(f"{where}: unknown field(s) {unknown} in a {what}")
    out: dict[str, Any] = {}
    for f in fields:
        if f.name not in raw:
            if f.required:
                raise RecordError(f"{where}: the {what} has no {f.name!r} field")
            continue
        value = raw[f.name]
        if f.record is not None and isinstance(value, dict):
            out[f.name] = decode(f.record, value, f"{what} {f.name}", where)
        elif any(_matches(value, t, origin) for t, origin in f.options):
            out[f.name] = float(value) if f.to_float and isinstance(value, int) else value
        else:
            raise RecordError(f"{where}: the {what}'s {f.name!r} is {value!r}, expected {f.hint}")
    return cls(**out)
