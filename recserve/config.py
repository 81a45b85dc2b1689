"""The one config mechanism: typed dataclasses, loadable from YAML, with argparse flags generated
from them.

A config is a dataclass whose fields carry a docstring each (the string literal after the field,
as in torchrec's ``EmbeddingBagConfig``); nested dataclasses (a PS server's ``store``, a store's
``table`` spec and its ``optimizer``) are flattened into the same flag namespace, so a field added
to a nested config is a flag of every command whose config nests it. A nested config's defaults
are its parent's (``TrainConfig.table`` has a learning rate of its own): flags and YAML change the
fields they name and keep the rest of the parent's default. Every subcommand builds its parser with
``add_arguments`` and its config with ``from_args``: defaults come from the dataclass, then the
``--config`` YAML file, then the flags the user typed. Nothing is copied by hand, so a flag cannot
be read without being defined.

Field metadata tunes a flag: ``flag`` (its name without ``--``; default the field name with
dashes), ``positional`` (a positional argument), ``choices``, ``metavar`` (what its value is
called in ``--help``), ``help`` (a short help line instead of the docstring), ``type`` (the flag's
parser instead of the field's type: it raises ``argparse.ArgumentTypeError`` naming what is wrong),
``cli=False`` (YAML only).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import os
import textwrap
import types
import typing
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import yaml

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def store_field(**metadata: Any):
    """The store-root field every config that touches the model store uses (one name, one flag)."""
    from model_store.layout import DEFAULT_ROOT, STORE_ENV, default_root

    help_text = f"model-store root (default ${STORE_ENV} or ./{DEFAULT_ROOT})"
    return dataclasses.field(default_factory=default_root, metadata={"help": help_text, **metadata})


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field docstrings (the string literal after each field), whitespace-normalised."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = cast(ast.ClassDef, tree.body[0]).body  # the source of a class is its class statement
    docs = {}
    for node, nxt in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unoptional(tp: Any) -> Any:
    """``X | None`` -> X."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _is_config(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _leaf_fields(cls: type, path: tuple[str, ...] = (), base: Any = None):
    """(dotted path, field, type, owner, default) of every non-dataclass field, nested configs
    flattened; ``default`` is the value in the parent's default (``base``) where there is one."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = _unoptional(hints[f.name])
        default = getattr(base, f.name) if base is not None else _default(f)
        if _is_config(tp):
            yield from _leaf_fields(
                tp, (*path, f.name), default if dataclasses.is_dataclass(default) else None
            )
        else:
            yield (*path, f.name), f, tp, cls, default


def _list_of(kind):
    def parse(s: str) -> list:
        return [kind(x.strip()) for x in s.split(",") if x.strip()]

    return parse


def add_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    yaml_flag: bool = True,
    skip: Collection[str] = frozenset(),
) -> None:
    """One flag per field of ``cls`` (nested configs flattened), each defaulting to "not given"
    so that YAML and dataclass defaults show through; ``--config FILE.yaml`` when ``yaml_flag``;
    fields whose flag's dest (``dests``) is in ``skip`` get none (another config of the same
    parser defines the flag: both read its value)."""
    if yaml_flag:
        parser.add_argument(
            "--config",
            dest="_config_file",
            metavar="FILE.yaml",
            help="YAML with these fields; flags override it",
        )
    seen: dict[str, str] = {}
    for path, f, tp, owner, default in _leaf_fields(cls):
        name, dest = _flag(f), _dest(f)
        if f.metadata.get("cli", True) is False or dest in skip:
            continue
        if name in seen:
            raise TypeError(f"{cls.__name__}: flag --{name} for both {seen[name]} and {'.'.join(path)}")
        seen[name] = ".".join(path)
        doc = f.metadata.get("help") or field_docs(owner).get(f.name, "")
        help_text = f"{doc} (default: {default})" if default not in (None, "", [], ()) else doc
        kw: dict[str, Any] = {"help": help_text.replace("%", "%%")}
        if "choices" in f.metadata:
            kw["choices"] = f.metadata["choices"]
        if "metavar" in f.metadata:
            kw["metavar"] = f.metadata["metavar"]
        origin = typing.get_origin(tp)
        if tp is bool and name.startswith("no-"):  # already a negative: argparse would read
            kw["action"] = "store_true"  # --no-x as "x off" under BooleanOptionalAction, i.e. False
        elif tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif origin in (list, tuple):
            kw["type"] = _list_of(typing.get_args(tp)[0])
            kw["metavar"] = "A,B,..."
        elif tp in (int, float, str):
            kw["type"] = f.metadata.get("type", tp)
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no flag for type {tp!r}")
        if f.metadata.get("positional"):
            kw.pop("action", None)
            parser.add_argument(dest, metavar=name.upper().replace("-", "_"), nargs="?", default=None, **kw)
        else:
            parser.add_argument(f"--{name}", dest=dest, default=None, **kw)


def _flag(f: dataclasses.Field) -> str:
    """A field's flag name, without ``--``."""
    return f.metadata.get("flag", f.name.replace("_", "-"))


def _dest(f: dataclasses.Field) -> str:
    """Where argparse puts a field's value: named after its flag, so that two configs of one
    parser that share a flag (``TrainConfig.table.capacity``, ``FollowConfig.capacity``) share it."""
    return _flag(f).replace("-", "_")


def dests(cls: type) -> set[str]:
    """The dests of ``cls``'s flags (``add_arguments``'s ``skip``)."""
    return {_dest(f) for _path, f, *_ in _leaf_fields(cls)}


def flags(cls: type) -> set[str]:
    """The flags of ``cls`` (``--a-b`` names; positionals and YAML-only fields have none)."""
    return {
        "--" + _flag(f)
        for _path, f, *_ in _leaf_fields(cls)
        if f.metadata.get("cli", True) is not False and not f.metadata.get("positional")
    }


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def from_dict(cls: type[T], d: dict | None, where: str = "", base: T | None = None) -> T:
    """Build ``cls`` from a (nested) dict; unknown keys are an error naming them. Fields the dict
    does not name come from ``base`` (a nested config: the parent field's default), else from
    ``cls``'s defaults."""
    d = dict(d or {})
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cast(Any, cls))}
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ValueError(f"unknown {cls.__name__} field(s) {unknown}{where}{_nested_hint(cls, unknown)}")
    for name, value in list(d.items()):
        tp = _unoptional(hints[name])
        if _is_config(tp) and isinstance(value, dict):
            inner = getattr(base, name) if base is not None else _default(fields[name])
            d[name] = from_dict(tp, value, where, inner if dataclasses.is_dataclass(inner) else None)
        elif typing.get_origin(tp) is tuple and isinstance(value, list):
            d[name] = tuple(value)
    if base is not None:
        d = {name: getattr(base, name) for name, f in fields.items() if f.init} | d
    return cls(**d)


def _nested_hint(cls: type, unknown: list[str]) -> str:
    """Where unknown keys belong when they are fields of one of ``cls``'s nested configs (a PS
    shard's ``port`` goes under ``server:``)."""
    hints = _hints(cls)
    homes = {
        key: f.name
        for f in dataclasses.fields(cast(Any, cls))
        if _is_config(tp := _unoptional(hints[f.name]))
        for key in unknown
        if key in {g.name for g in dataclasses.fields(tp)}
    }
    return "".join(f"; {key} goes under {home}:" for key, home in homes.items())


def to_dict(config: Any) -> dict:
    return dataclasses.asdict(config)


def load_yaml(cls: type[T], path: str | os.PathLike) -> T:
    return from_dict(cls, yaml.safe_load(Path(path).read_text()) or {}, f" in {path}")


def raw_from_args(cls: type, args: argparse.Namespace) -> dict:
    """The nested dict of the YAML file (if any) overlaid with the flags the user gave."""
    path = getattr(args, "_config_file", None)
    raw = (yaml.safe_load(Path(path).read_text()) or {}) if path else {}
    for dotted, f, *_ in _leaf_fields(cls):
        value = getattr(args, _dest(f), None)
        if value is None:
            continue
        node = raw
        for key in dotted[:-1]:
            node = node.setdefault(key, {})
        node[dotted[-1]] = value
    return raw


def from_args(cls: type[T], args: argparse.Namespace) -> T:
    """``cls`` from its defaults, then ``--config`` YAML, then the flags given."""
    path = getattr(args, "_config_file", None)
    return from_dict(cls, raw_from_args(cls, args), f" in {path}" if path else "")


def given(cls: type, args: argparse.Namespace) -> list[str]:
    """The flags of ``cls`` the user actually typed (``--a-b`` names)."""
    out = []
    for _dotted, f, *_ in _leaf_fields(cls):
        if getattr(args, _dest(f), None) is not None:
            out.append("--" + _flag(f))
    return out
