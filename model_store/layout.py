"""The model store on disk: paths, versions, staging, deltas, the done marker, CURRENT.

Layout::

    <root>/<model>/<version>/        version = "1", "2", ... (the next integer)
        MANIFEST.json                format, model, version, parent, created, schema_fingerprint,
                                     model_config (with the fitted dense_mean/dense_std), dim,
                                     num_shards, dense paths, metrics, and "files": {relpath:
                                     digest} for every file but MANIFEST/_SUCCESS
        schema.yaml                  the feature schema as written (features.schema.dump_schema)
        embeddings/shard-<i>-of-<n>/ full PS dumps (model_store.shards layout)
        dense/model.pt, model.onnx   the dense network (it applies the fitted dense statistics)
        eval/scores.npy              the trainer's own test-split probabilities
        stream/DELTA.json            a full version from the stream: where the stream resumes from it
                                     (offsets, trained keys: model_store.deltas)
        deltas/<seq>/shard-<i>-of-<n>/ + deltas/<seq>/_SUCCESS   row deltas (own manifests)
        _SUCCESS                     written last
    <root>/<model>/CURRENT           the served version (temp file + os.replace: atomic)
    <root>/<model>/HISTORY, REFUSED  published versions; the gate's quality refusals (model_store.releases)
    <root>/<model>/PINNED            versions retention keeps (model_store.retention)

A version is written under a hidden staging name (``.staging-<version>-<uuid>``) and renamed into
place after its ``_SUCCESS``, so a reader sees a complete version or none. ``model_store.manifest.read_manifest``
refuses a version without ``_SUCCESS`` or whose files do not match their checksums. Files under
``deltas/`` that are not in the manifest are allowed: deltas cut after the version was sealed
(continuous training, ``training.follow.cut.DeltaWriter``) carry their own per-shard manifests and
``_SUCCESS``.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Container
from pathlib import Path

FORMAT = 1
MANIFEST = "MANIFEST.json"
SUCCESS = "_SUCCESS"
CURRENT = "CURRENT"
DELTAS = "deltas"
STAGING = ".staging-"


STORE_ENV = "RECSERVE_STORE"
DEFAULT_ROOT = "artifacts"


def default_root() -> str:
    """The store root every command defaults to: ``$RECSERVE_STORE``, else ``./artifacts``
    (a plain directory, gitignored, never a source package)."""
    return os.environ.get(STORE_ENV) or DEFAULT_ROOT


# ---- paths and versions -------------------------------------------------------------------------
def model_dir(root: str | os.PathLike[str], model: str) -> Path:
    if not model or "/" in model or model.startswith("."):
        raise ValueError(f"bad model name {model!r}")
    return Path(root) / model


def version_dir(root: str | os.PathLike[str], model: str, version: str | int) -> Path:
    return model_dir(root, model) / str(version)


def versions(root: str | os.PathLike[str], model: str, complete_only: bool = True) -> list[str]:
    """Version names of a model in numeric order (only those with ``_SUCCESS`` by default)."""
    d = model_dir(root, model)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if p.is_dir() and p.name.isdigit()]
    if complete_only:
        found = [p for p in found if (p / SUCCESS).is_file()]
    return [p.name for p in sorted(found, key=lambda p: int(p.name))]


def next_version(root: str | os.PathLike[str], model: str) -> str:
    """One more than the highest version present (complete or not, staged or not)."""
    d = model_dir(root, model)
    numbers = [0]
    if d.is_dir():
        for p in d.iterdir():
            name = p.name[len(STAGING) :].split("-")[0] if p.name.startswith(STAGING) else p.name
            if name.isdigit():
                numbers.append(int(name))
    return str(max(numbers) + 1)


def staging_dir(root: str | os.PathLike[str], model: str, version: str) -> Path:
    """A fresh hidden directory to write ``version`` into before ``seal`` renames it."""
    d = model_dir(root, model) / f"{STAGING}{version}-{uuid.uuid4().hex[:8]}"
    d.mkdir(parents=True)
    return d


# ---- deltas ------------------------------------------------------------------------------------
def delta_dir(version_path: str | os.PathLike[str], seq: int) -> Path:
    return Path(version_path) / DELTAS / str(seq)


def list_deltas(
    version_path: str | os.PathLike[str], after: int = -1, known: Container[int] = ()
) -> list[int]:
    """Sequence numbers of the complete deltas (with ``_SUCCESS``) of a version after ``after``,
    ascending (a follower passes the one it holds: it looks at the markers of new deltas only);
    ``known``: seqs the caller has (not listed, their markers not looked at: a reader of every
    delta as it lands looks at the new ones only)."""
    d = Path(version_path) / DELTAS
    if not d.is_dir():
        return []
    return sorted(
        seq
        for p in d.iterdir()
        if p.name.isdigit() and (seq := int(p.name)) > after and seq not in known and (p / SUCCESS).is_file()
    )


def mark_done(directory: str | os.PathLike[str]) -> None:
    """Write ``_SUCCESS`` into a finished directory, last: the one writer of the done marker (a
    sealed version, a shard dump, a delta). Readers take a directory without it as unfinished."""
    write_atomic(Path(directory) / SUCCESS, b"")


# ---- CURRENT -----------------------------------------------------------------------------------
def current(root: str | os.PathLike[str], model: str) -> str | None:
    """The published version of ``model`` (None when nothing is published)."""
    try:
        return (model_dir(root, model) / CURRENT).read_text().strip() or None
    except FileNotFoundError:
        return None


def set_current(root: str | os.PathLike[str], model: str, version: str | int) -> Path:
    """Point CURRENT at ``version`` atomically. No checks: call ``model_store.publish`` (the gate
    plus HISTORY), never this, to release a version."""
    path = model_dir(root, model) / CURRENT
    write_atomic(path, f"{version}\n".encode())
    return path


def discard(path: str | os.PathLike[str]) -> None:
    """Remove a staged (never sealed) version directory."""
    shutil.rmtree(path, ignore_errors=True)


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write a file so that a reader sees the old content or the new, never a part (temp file,
    fsync, rename)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename in ``path`` durable."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
