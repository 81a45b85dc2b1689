"""The feature schema: typed dataclasses loaded from YAML, shared by training and serving."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from features.hashing import MAX_SLOT_ID

Kind = Literal["categorical", "multi", "dense"]
Scope = Literal["context", "item"]


class SchemaError(ValueError):
    """A schema file that cannot be used: the message names the slot and the problem."""


@dataclass(frozen=True)
class DenseTransform:
    """How a raw dense value becomes a model input: missing -> default, then clip, log1p, standardise."""

    default: float = 0.0  # raw value used when the field is missing or empty
    clip_min: float | None = None  # lower bound applied first (e.g. 0 before log1p)
    clip_max: float | None = None  # upper bound applied first
    log1p: bool = False  # apply log(1 + x) after clipping
    # standardise with given values: (x - mean) / std. Part of the feature contract (a client
    # applies it); the statistics fitted by training live in the model version, not here
    mean: float | None = None
    std: float | None = None  # must be > 0 when given; both or neither of mean/std


@dataclass(frozen=True)
class Slot:
    """One input feature."""

    name: str  # feature name, unique in the schema
    kind: Kind = "categorical"  # categorical (one value), multi (a list or separator-joined), dense
    column: str = ""  # source column in records/files; defaults to the name
    scope: Scope = "item"  # context: one value per request; item: one per row
    id: int = 0  # categorical only: the slot id in the top 16 bits of its signs (0: assigned)
    separator: str = "|"  # multi only: separator of a joined string value
    pooling: Literal["sum", "mean"] = "sum"  # how the worker pools a multi-valued slot's rows
    required: bool = False  # a request that omits this field is rejected
    transform: DenseTransform = field(default_factory=DenseTransform)  # dense only


@dataclass(frozen=True)
class Cross:
    """A categorical feature made from two single-valued categorical slots (a x b)."""

    name: str  # feature name, unique in the schema
    slots: tuple[str, str]  # the two categorical slots crossed
    id: int = 0  # slot id of the crossed signs (0: assigned)

    @property
    def kind(self) -> str:
        return "categorical"


@dataclass(frozen=True)
class Schema:
    """Slots in order; sparse slots (categorical, multi, then crosses) define the batch slot order."""

    name: str  # schema name (e.g. criteo)
    slots: tuple[Slot, ...]  # input features in file order
    crosses: tuple[Cross, ...] = ()  # derived categorical features
    label: str | None = None  # label column in training data (absent in scoring requests)

    def __post_init__(self) -> None:
        _validate(self)

    # --- derived views (cheap; computed on access) ---------------------------------------
    @functools.cached_property
    def sparse(self) -> tuple[Slot | Cross, ...]:
        """Categorical + multi slots then crosses: the slot order of a CompactBatch."""
        return tuple(s for s in self.slots if s.kind != "dense") + self.crosses

    @functools.cached_property
    def dense(self) -> tuple[Slot, ...]:
        return tuple(s for s in self.slots if s.kind == "dense")

    def scope_of(self, feature: Slot | Cross) -> Scope:
        if isinstance(feature, Cross):
            by_name = {s.name: s for s in self.slots}
            both = {by_name[n].scope for n in feature.slots}
            return "context" if both == {"context"} else "item"
        return feature.scope

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 of the canonical JSON of the schema: equal schemas, equal fingerprints. A schema
        holds the feature contract only (fitted statistics live in the model version), so models
        retrained from the same schema file share it."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    @functools.cached_property
    def hash64(self) -> int:
        """The first 8 bytes of the fingerprint: carried in every compact batch header."""
        return int(self.fingerprint[:16], 16)


def _validate(schema: Schema) -> None:
    names = [s.name for s in schema.slots] + [c.name for c in schema.crosses]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise SchemaError(f"schema {schema.name}: duplicate feature names {sorted(dup)}")
    ids = [f.id for f in schema.sparse]
    if any(not 0 < i <= MAX_SLOT_ID for i in ids):
        raise SchemaError(f"schema {schema.name}: slot ids must be in 1..{MAX_SLOT_ID}")
    if len(set(ids)) != len(ids):
        raise SchemaError(f"schema {schema.name}: duplicate slot ids")
    by_name = {s.name: s for s in schema.slots}
    for c in schema.crosses:
        for n in c.slots:
            if n not in by_name or by_name[n].kind != "categorical":
                raise SchemaError(f"cross {c.name}: {n!r} is not a single-valued categorical slot")
    for s in schema.slots:
        t = s.transform
        if s.kind not in ("categorical", "multi", "dense"):
            raise SchemaError(f"slot {s.name}: unknown kind {s.kind!r}")
        if s.scope not in ("context", "item"):
            raise SchemaError(f"slot {s.name}: unknown scope {s.scope!r}")
        if (t.mean is None) != (t.std is None) or (t.std is not None and not t.std > 0):
            raise SchemaError(f"slot {s.name}: standardise needs both mean and std > 0")
        if s.kind == "multi" and not s.separator:
            raise SchemaError(f"slot {s.name}: multi-valued slot needs a separator")


def schema_from_dict(d: dict[str, Any]) -> Schema:
    """Build a schema from its YAML/JSON form, assigning slot ids in order where not given."""
    try:
        slots = []
        for raw in d.get("slots", []):
            raw = dict(raw)
            raw.setdefault("column", raw["name"])
            if "transform" in raw:
                raw["transform"] = DenseTransform(**(raw["transform"] or {}))
            slots.append(Slot(**raw))
        crosses = [Cross(**{**c, "slots": tuple(c["slots"])}) for c in d.get("crosses", []) or []]
    except (TypeError, KeyError) as e:
        raise SchemaError(f"schema {d.get('name', '?')}: {e}") from None
    used = {s.id for s in slots} | {c.id for c in crosses}
    next_id = iter(i for i in range(1, MAX_SLOT_ID + 1) if i not in used)
    slots = [s if s.kind == "dense" or s.id else dataclasses.replace(s, id=next(next_id)) for s in slots]
    crosses = [c if c.id else dataclasses.replace(c, id=next(next_id)) for c in crosses]
    return Schema(
        name=d.get("name", "schema"), slots=tuple(slots), crosses=tuple(crosses), label=d.get("label")
    )


def load_schema(path: str | Path) -> Schema:
    """Load a schema YAML file (see data/schemas/)."""
    with open(path) as f:
        d = yaml.safe_load(f)
    if not isinstance(d, dict):
        raise SchemaError(f"{path}: not a schema mapping")
    return schema_from_dict(d)


def dump_schema(schema: Schema) -> str:
    """YAML text of a schema (ids made explicit), e.g. for the model store."""
    return yaml.safe_dump(schema.to_dict(), sort_keys=False)
