"""Release management over the model store: list, validate, publish, roll back, retain.

Builds on ``model_store.layout`` (paths, the atomic CURRENT switch) and ``model_store.manifest``
(reading and verifying a version) and adds what
an operator needs: a publish history (``<model>/HISTORY``, one version per line, appended on every
publish) so ``rollback`` returns to the previously published version; THE gate (``validate``):
whether a version can replace the served one, run by publish, rollback and every serving
component; the refusals of its quality rules, kept in ``<model>/REFUSED`` for ``recserve
versions``. Retention of the last N versions: ``model_store.retention``. Nothing without ``_SUCCESS``, with a bad checksum,
or that the running stack would refuse is ever published (unless a schema change is allowed).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from model_store import layout as ms
from model_store.errors import (
    IncompatibleVersion,
    IncompleteVersion,
    ModelStoreError,
    QualityDrop,
    QuantizationLoss,
    SchemaMismatch,
    VersionNotFound,
)
from model_store.manifest import QuantRecord, StreamRecord, VersionManifest, read_manifest

HISTORY = "HISTORY"
REFUSED = "REFUSED"
MAX_QUANT_AUC_DROP = 0.001
"""How far below its own float32 test AUC a version served in float16 or int8 may score."""
MAX_AUC_DROP = 0.01
"""How far below the served version's progressive AUC on the same window a full version from the
stream may score."""

Root = str | os.PathLike[str]  # the store's root directory


@dataclass
class VersionInfo:
    version: str
    status: str  # ok | incomplete | corrupt
    current: bool
    detail: str = ""
    created: float | None = None
    metrics: dict[str, Any] | None = None
    deltas: int = 0
    quantized: QuantRecord | None = None
    stream: StreamRecord | None = None
    refused: str = ""
    """Why the gate refused to publish it ('' : it did not; ``<model>/REFUSED``)."""


# What a running stack cannot change under its processes, each as (manifest attribute, what it
# is): the worker decodes batches with the feature schema it started with and every PS shard
# refuses rows of another schema hash or dim; the dense network's inputs are slots x dim + dense.
CONTRACT: tuple[tuple[str, str], ...] = (
    ("schema_fingerprint", "feature schema"),
    ("dim", "embedding dim"),
    ("num_slots", "number of sparse slots"),
    ("num_dense", "number of dense inputs"),
)


def validate(
    root: Root, model: str, version: str, served: VersionManifest | None = None, verify: bool = True,
    max_quant_auc_drop: float = MAX_QUANT_AUC_DROP, max_auc_drop: float | None = None,
) -> VersionManifest:  # fmt: skip
    """THE gate: the manifest of ``version`` if it can replace the served version whose manifest is
    ``served`` (None: nothing served, only the version's own validity counts), else a typed
    ModelStoreError naming both sides.

    Valid: the directory exists, ``_SUCCESS``, a readable manifest, (``verify``) the checksum of every
    file. Compatible with ``served``: the same value for every ``CONTRACT`` key present in both
    manifests (IncompatibleVersion; SchemaMismatch for the feature schema). ``recserve publish``,
    ``train --publish`` and rollback call it with CURRENT's manifest (``current_manifest``), the
    controller with the dense version it serves, every PS follower with the version it serves, so
    CURRENT never names a version that serving refuses. ``verify=False`` skips the checksum of every
    file (a PS checks its own shard files as it reads them). A version served in a reduced-precision
    dtype whose export measured a test AUC more than ``max_quant_auc_drop`` below its own float32
    one is refused (QuantizationLoss), served or not. ``max_auc_drop`` (``publish`` gives it; None:
    not judged): a full version from the stream whose progressive AUC on its latest window is more
    than that below the version serving then, on the same samples, cannot replace a served version
    (QualityDrop). A release decision, taken once when publishing: a serving component does not
    judge it again (an operator may publish past it with a larger allowance)."""
    vdir = ms.version_dir(root, model, version)
    if not vdir.is_dir():
        raise VersionNotFound(f"{model} version {version} does not exist in {root}")
    manifest = read_manifest(vdir, verify=verify)
    q = manifest.quantized
    if q is not None and not q.auc_drop <= max_quant_auc_drop:  # NaN fails too
        raise QuantizationLoss(
            f"{model} version {version} is served in {q.dtype}: its test AUC {q.auc:.5f} is "
            f"{q.auc_drop:.5f} below its float32 AUC {q.float32_auc:.5f}, more than the allowed "
            f"{max_quant_auc_drop:g} (export it in a wider serving dtype, or raise --max-quant-auc-drop)"
        )
    if served is None:
        return manifest
    st = manifest.stream
    if (
        max_auc_drop is not None
        and st is not None
        and st.auc_drop is not None
        and not st.auc_drop <= max_auc_drop
    ):
        raise QualityDrop(
            f"{model} version {version}: its progressive AUC {st.auc:.5f} on the latest {st.samples} "
            f"samples is {st.auc_drop:.5f} below version {st.served_version}'s {st.served_auc:.5f} on "
            f"the same samples, more than the allowed {max_auc_drop:g} (--max-auc-drop)"
        )
    for key, what in CONTRACT:
        mine, theirs = getattr(manifest, key), getattr(served, key)
        if mine is None or theirs is None or mine == theirs:
            continue
        short: Callable[[object], str] = (lambda v: str(v)[:12]) if key == "schema_fingerprint" else str
        error = SchemaMismatch if key == "schema_fingerprint" else IncompatibleVersion
        raise error(
            f"{model} version {version} cannot replace the served version {served.version}: "
            f"its {what} is {short(mine)}, the served version's is {short(theirs)} (serving refuses it; "
            "a new schema or shape needs a new stack: `recserve publish --allow-schema-change`, then "
            "restart the stack)"
        )
    return manifest


def current_manifest(root: Root, model: str) -> VersionManifest | None:
    """The manifest of the version CURRENT names -- what a running stack serves or is switching to
    -- (unverified: it passed the gate when published), or None when nothing is published."""
    cur = ms.current(root, model)
    if cur is None:
        return None
    try:
        return read_manifest(ms.version_dir(root, model, cur), verify=False)
    except ModelStoreError as e:
        raise ModelStoreError(
            f"{model}: CURRENT names version {cur}, whose manifest cannot be read ({e}): cannot tell "
            "what serving serves (`--allow-schema-change` publishes without comparing)"
        ) from None


def list_versions(root: Root, model: str) -> list[VersionInfo]:
    """Every version directory (complete or not), oldest first, with its state."""
    cur = ms.current(root, model)
    out = []
    why = refusals(root, model)
    for v in ms.versions(root, model, complete_only=False):
        try:
            m = read_manifest(ms.version_dir(root, model, v), verify=True)
            info = VersionInfo(v, "ok", v == cur, created=m.created, metrics=m.metrics, quantized=m.quantized,
                               stream=m.stream, refused=why.get(v, ""))  # fmt: skip
            info.deltas = len(ms.list_deltas(ms.version_dir(root, model, v)))
        except ModelStoreError as e:
            status = "incomplete" if isinstance(e, IncompleteVersion) else "corrupt"
            info = VersionInfo(v, status, v == cur, detail=str(e))
        out.append(info)
    return out


def history(root: Root, model: str) -> list[str]:
    try:
        return [v for v in (ms.model_dir(root, model) / HISTORY).read_text().split() if v]
    except FileNotFoundError:
        cur = ms.current(root, model)
        return [cur] if cur else []


def publish(
    root: Root, model: str, version: str, allow_schema_change: bool = False,
    max_quant_auc_drop: float = MAX_QUANT_AUC_DROP, max_auc_drop: float = MAX_AUC_DROP,
) -> str:  # fmt: skip
    """Make ``version`` CURRENT (atomic) if it passes the gate against CURRENT's version; record it
    in the history. ``allow_schema_change``: check only the version's own validity (a deliberate
    change of schema or shape, served by a new stack). ``max_quant_auc_drop``: the gate's allowance
    for a version served in float16 or int8; ``max_auc_drop``: for a full version from the stream.
    A refusal by a quality rule is recorded (``refusals``) before it is raised."""
    served = None if allow_schema_change else current_manifest(root, model)
    try:
        validate(
            root, model, version, served, max_quant_auc_drop=max_quant_auc_drop, max_auc_drop=max_auc_drop
        )
    except (QualityDrop, QuantizationLoss) as e:
        _refuse(root, model, version, str(e))
        raise
    previous = history(root, model)
    ms.set_current(root, model, version)
    if not previous or previous[-1] != version:
        ms.write_atomic(
            ms.model_dir(root, model) / HISTORY, ("\n".join([*previous, version]) + "\n").encode()
        )
    return version


def rollback(root: Root, model: str, allow_schema_change: bool = False) -> str:
    """Re-publish the most recent earlier version that passes the gate against CURRENT's version
    (``allow_schema_change``: that is still valid); returns it."""
    hist = history(root, model)
    cur = ms.current(root, model)
    served = None if allow_schema_change else current_manifest(root, model)
    candidates = [v for v in reversed(hist) if v != cur]
    errors = []
    for v in candidates:
        try:
            validate(root, model, v, served)
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


def refusals(root: Root, model: str) -> dict[str, str]:
    """Version -> why the gate's quality rules refused to publish it (the last refusal), from
    ``<model>/REFUSED`` (one JSON object a line: version, why, time)."""
    try:
        lines = (ms.model_dir(root, model) / REFUSED).read_text().splitlines()
    except FileNotFoundError:
        return {}
    out = {}
    for line in lines:
        try:
            entry = json.loads(line)
            out[str(entry["version"])] = str(entry["why"])
        except (ValueError, KeyError, TypeError):
            raise ModelStoreError(
                f"{ms.model_dir(root, model) / REFUSED}: unreadable line {line!r}"
            ) from None
    return out


def _refuse(root: Root, model: str, version: str, why: str) -> None:
    path = ms.model_dir(root, model) / REFUSED
    try:
        old = path.read_bytes()
    except FileNotFoundError:
        old = b""
    line = json.dumps({"version": version, "why": why, "time": time.time()}) + "\n"
    ms.write_atomic(path, old + line.encode())
