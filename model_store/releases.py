"""Release management over the model store: list, validate, publish, roll back, retain.

Builds on ``model_store.layout`` (layout, manifests, the atomic CURRENT switch) and adds what
an operator needs: a publish history (``<model>/HISTORY``, one version per line, appended on every
publish) so ``rollback`` returns to the previously published version; a validation gate that also
checks the feature-schema fingerprint against the schema being served; retention of the last N
versions. Nothing without ``_SUCCESS`` or with a bad checksum is ever published.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from model_store import layout as ms
from model_store.errors import IncompleteVersion, ModelStoreError, SchemaMismatch, VersionNotFound
from model_store.manifest import read_manifest

HISTORY = "HISTORY"


@dataclass
class VersionInfo:
    version: str
    status: str  # ok | incomplete | corrupt
    current: bool
    detail: str = ""
    created: float | None = None
    metrics: dict | None = None
    deltas: int = 0


def validate(
    root, model: str, version: str, schema_fingerprint: str | None = None, verify: bool = True
) -> dict:
    """THE gate: the manifest of a version fit to serve, or a typed ModelStoreError saying why not.

    ``recserve publish``, ``train --publish``, rollback, the controller and every PS follower call
    this one function, so CURRENT never names a version that serving refuses. ``verify=False``
    skips the sha256 of every file (a PS checks its own shard files as it reads them)."""
    vdir = ms.version_dir(root, model, version)
    if not vdir.is_dir():
        raise VersionNotFound(f"{model} version {version} does not exist in {root}")
    manifest = read_manifest(vdir, verify=verify)
    if schema_fingerprint and manifest.get("schema_fingerprint") != schema_fingerprint:
        raise SchemaMismatch(
            f"{model} version {version} was trained with feature schema {str(manifest.get('schema_fingerprint'))[:12]}, "
            f"the served schema is {schema_fingerprint[:12]}: refusing it"
        )
    return manifest


def list_versions(root, model: str) -> list[VersionInfo]:
    """Every version directory (complete or not), oldest first, with its state."""
    cur = ms.current(root, model)
    out = []
    for v in ms.versions(root, model, complete_only=False):
        try:
            m = read_manifest(ms.version_dir(root, model, v), verify=True)
            info = VersionInfo(v, "ok", v == cur, created=m.get("created"), metrics=m.get("metrics"))
            info.deltas = len(ms.list_deltas(ms.version_dir(root, model, v)))
        except ModelStoreError as e:
            status = "incomplete" if isinstance(e, IncompleteVersion) else "corrupt"
            info = VersionInfo(v, status, v == cur, detail=str(e))
        out.append(info)
    return out


def history(root, model: str) -> list[str]:
    try:
        return [v for v in (ms.model_dir(root, model) / HISTORY).read_text().split() if v]
    except FileNotFoundError:
        cur = ms.current(root, model)
        return [cur] if cur else []


def publish(root, model: str, version: str, schema_fingerprint: str | None = None) -> str:
    """Validate ``version`` and make it CURRENT (atomic); record it in the history."""
    validate(root, model, version, schema_fingerprint)
    previous = history(root, model)
    ms.set_current(root, model, version)
    if not previous or previous[-1] != version:
        ms.write_atomic(
            ms.model_dir(root, model) / HISTORY, ("\n".join([*previous, version]) + "\n").encode()
        )
    return version


def rollback(root, model: str, schema_fingerprint: str | None = None) -> str:
    """Re-publish the most recent earlier version that still validates; returns it."""
    hist = history(root, model)
    cur = ms.current(root, model)
    candidates = [v for v in reversed(hist) if v != cur]
    errors = []
    for v in candidates:
        try:
            validate(root, model, v, schema_fingerprint)
        except ModelStoreError as e:
            errors.append(str(e))
            continue
        ms.set_current(root, model, v)
        kept = hist[: len(hist) - hist[::-1].index(v)]  # history up to (and including) v
        ms.write_atomic(ms.model_dir(root, model) / HISTORY, ("\n".join(kept) + "\n").encode())
        return v
    raise VersionNotFound(
        f"{model}: no earlier published version to roll back to"
        + (f" ({'; '.join(errors)})" if errors else "")
    )


def retain(root, model: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete versions; never CURRENT or the rollback target.
    Incomplete versions older than the newest complete one and stale staging dirs go too."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    cur = ms.current(root, model)
    hist = history(root, model)
    protected = {cur, *(hist[-2:] if hist else [])}
    complete = ms.versions(root, model)
    newest = set(complete[-keep:])
    removed = []
    for v in ms.versions(root, model, complete_only=False):
        if v in protected or v in newest:
            continue
        if v in complete or (complete and int(v) < int(complete[-1])):
            shutil.rmtree(ms.version_dir(root, model, v))
            removed.append(v)
    for stale in Path(ms.model_dir(root, model)).glob(".staging-*"):
        if complete and stale.name[len(".staging-") :].split("-")[0].isdigit():
            if int(stale.name[len(".staging-") :].split("-")[0]) < int(complete[-1]):
                shutil.rmtree(stale, ignore_errors=True)
                removed.append(stale.name)
    return removed
