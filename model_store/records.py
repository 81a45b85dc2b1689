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


def _matches(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp) or tp
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


def decode(cls: type[T], raw: object, what: str, where: str, formats: tuple[Any, ...] = ()) -> T:
    """``cls`` from the parsed JSON ``raw`` of the ``what`` record in ``where``; ``formats``: the
    ``format`` values this release reads (default: ``cls``'s own)."""
    if not isinstance(raw, dict):
        raise RecordError(f"{where}: a {what} is a JSON object, found {type(raw).__name__}")
    names = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    if "format" in names:
        known = formats or (names["format"].default,)
        if raw.get("format") not in known:
            raise UnknownFormat(
                f"{where}: {what} format {raw.get('format')!r}; this recserve reads format "
                f"{' or '.join(map(repr, known))} (written by another recserve release?)"
            )
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise RecordError(f"{where}: unknown field(s) {unknown} in a {what}")
    hints = _hints(cast(Any, cls))
    out: dict[str, Any] = {}
    for name, f in names.items():
        if name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise RecordError(f"{where}: the {what} has no {name!r} field")
            continue
        value, options = raw[name], _options(hints[name])
        record = next((t for t in options if isinstance(t, type) and dataclasses.is_dataclass(t)), None)
        if record is not None and isinstance(value, dict):
            out[name] = decode(record, value, f"{what} {name}", where)
        elif any(_matches(value, t) for t in options):
            out[name] = float(value) if float in options and isinstance(value, int) else value
        else:
            raise RecordError(f"{where}: the {what}'s {name!r} is {value!r}, expected {hints[name]}")
    return cls(**out)
