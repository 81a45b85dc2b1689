"""The model store on disk: versions, manifests, publish. Written by the trainer, read by serving.

Layout (see DESIGN.md)::

    <root>/<model>/<version>/        version = "1", "2", ... (the next integer)
        MANIFEST.json                format, model, version, parent, created, schema_fingerprint,
                                     model_config, dim, num_shards, dense paths, metrics, and
                                     "files": {relpath: sha256} for every file but MANIFEST/_SUCCESS
        schema.yaml                  the exact feature schema (features.schema.dump_schema)
        embeddings/shard-<i>-of-<n>/ full PS dumps (serving.ps.persist layout)
        dense/model.pt, model.onnx   the dense network
        eval/scores.npy              the trainer's own test-split probabilities
        deltas/<seq>/shard-<i>-of-<n>/ + deltas/<seq>/_SUCCESS   row deltas (own manifests)
        _SUCCESS                     written last
    <root>/<model>/CURRENT           the served version (temp file + os.replace: atomic)

A version is written under a hidden staging name (``.staging-<version>-<uuid>``) and renamed into
place after its ``_SUCCESS``, so a reader sees a complete version or none. ``read_manifest``
refuses a version without ``_SUCCESS`` or whose files do not match their checksums. Files under
``deltas/`` that are not in the manifest are allowed: deltas cut after the version was sealed
(``--follow``) carry their own per-shard manifests and ``_SUCCESS``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path

FORMAT = 1
MANIFEST = "MANIFEST.json"
SUCCESS = "_SUCCESS"
CURRENT = "CURRENT"
DELTAS = "deltas"
_STAGING = ".staging-"


class ModelStoreError(Exception):
    """A version that cannot be used (incomplete, corrupt, missing); the message says why."""


# ---- paths and versions -------------------------------------------------------------------------
def model_dir(root: str | os.PathLike, model: str) -> Path:
    if not model or "/" in model or model.startswith("."):
        raise ValueError(f"bad model name {model!r}")
    return Path(root) / model


def version_dir(root: str | os.PathLike, model: str, version: str | int) -> Path:
    return model_dir(root, model) / str(version)


def versions(root: str | os.PathLike, model: str, complete_only: bool = True) -> list[str]:
    """Version names of a model in numeric order (only those with ``_SUCCESS`` by default)."""
    d = model_dir(root, model)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if p.is_dir() and p.name.isdigit()]
    if complete_only:
        found = [p for p in found if (p / SUCCESS).is_file()]
    return [p.name for p in sorted(found, key=lambda p: int(p.name))]


def next_version(root: str | os.PathLike, model: str) -> str:
    """One more than the highest version present (complete or not, staged or not)."""
    d = model_dir(root, model)
    numbers = [0]
    if d.is_dir():
        for p in d.iterdir():
            name = p.name[len(_STAGING) :].split("-")[0] if p.name.startswith(_STAGING) else p.name
            if name.isdigit():
                numbers.append(int(name))
    return str(max(numbers) + 1)


def staging_dir(root: str | os.PathLike, model: str, version: str) -> Path:
    """A fresh hidden directory to write ``version`` into before ``seal`` renames it."""
    d = model_dir(root, model) / f"{_STAGING}{version}-{uuid.uuid4().hex[:8]}"
    d.mkdir(parents=True)
    return d


# ---- manifests ----------------------------------------------------------------------------------
def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_checksums(directory: str | os.PathLike) -> dict[str, str]:
    """sha256 of every file under ``directory`` (posix relpaths) except the top MANIFEST/_SUCCESS."""
    root = Path(directory)
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel not in (MANIFEST, SUCCESS):
            out[rel] = sha256_file(p)
    return out


def write_manifest(directory: str | os.PathLike, manifest: dict) -> dict:
    """Write MANIFEST.json with ``format``, ``created`` and the checksums of every file now in
    ``directory`` filled in; returns the manifest written."""
    directory = Path(directory)
    full = {"format": FORMAT, "created": time.time(), **manifest, "files": file_checksums(directory)}
    _write_atomic(directory / MANIFEST, json.dumps(full, indent=2, sort_keys=True).encode())
    return full


def seal(staging: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Write ``_SUCCESS`` into a staged version and rename it to its final name."""
    staging, final = Path(staging), Path(final)
    if final.exists():
        raise ModelStoreError(f"{final} already exists")
    _write_atomic(staging / SUCCESS, b"")
    os.replace(staging, final)
    _fsync_dir(final.parent)
    return final


def read_manifest(directory: str | os.PathLike, verify: bool = True) -> dict:
    """The manifest of a complete version; raises ModelStoreError where ``_SUCCESS`` is missing,
    the manifest is unreadable, or (``verify``) a file is missing, unlisted or fails its sha256."""
    d = Path(directory)
    if not (d / SUCCESS).is_file():
        raise ModelStoreError(f"{d}: no {SUCCESS}: the version is incomplete, refusing it")
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ModelStoreError(f"{d}: cannot read {MANIFEST}: {e}") from None
    if manifest.get("format") != FORMAT:
        raise ModelStoreError(f"{d}: manifest format {manifest.get('format')!r}, expected {FORMAT}")
    if verify:
        listed = manifest.get("files", {})
        present = {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()} - {MANIFEST, SUCCESS}
        missing = sorted(set(listed) - present)
        if missing:
            raise ModelStoreError(f"{d}: files in the manifest are missing: {missing[:5]}")
        extra = sorted(p for p in present - set(listed) if not p.startswith(DELTAS + "/"))
        if extra:
            raise ModelStoreError(f"{d}: files not in the manifest: {extra[:5]}")
        for rel, digest in listed.items():
            if sha256_file(d / rel) != digest:
                raise ModelStoreError(f"{d}: checksum mismatch for {rel}")
    return manifest


def verify_files(directory: str | os.PathLike, manifest: dict, names: list[str]) -> None:
    """Check the sha256 of just the listed files a reader is about to use (a handler needs the
    dense model and schema, not every embedding shard; PS shard dumps carry their own checksums)."""
    d = Path(directory)
    listed = manifest.get("files", {})
    for rel in names:
        if rel not in listed:
            raise ModelStoreError(f"{d}: {rel} is not in the manifest")
        if not (d / rel).is_file() or sha256_file(d / rel) != listed[rel]:
            raise ModelStoreError(f"{d}: checksum mismatch for {rel}")


# ---- deltas ------------------------------------------------------------------------------------
def delta_dir(version_path: str | os.PathLike, seq: int) -> Path:
    return Path(version_path) / DELTAS / str(seq)


def list_deltas(version_path: str | os.PathLike) -> list[int]:
    """Sequence numbers of the complete deltas (with ``_SUCCESS``) of a version, ascending."""
    d = Path(version_path) / DELTAS
    if not d.is_dir():
        return []
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and (p / SUCCESS).is_file())


def mark_done(directory: str | os.PathLike) -> None:
    """Write ``_SUCCESS`` into a finished directory (a delta), last."""
    _write_atomic(Path(directory) / SUCCESS, b"")


# ---- publish -----------------------------------------------------------------------------------
def current(root: str | os.PathLike, model: str) -> str | None:
    """The published version of ``model`` (None when nothing is published)."""
    try:
        return (model_dir(root, model) / CURRENT).read_text().strip() or None
    except FileNotFoundError:
        return None


def publish(root: str | os.PathLike, model: str, version: str | int) -> Path:
    """Point CURRENT at ``version`` atomically, after verifying the version is complete and intact."""
    read_manifest(version_dir(root, model, version))
    path = model_dir(root, model) / CURRENT
    _write_atomic(path, f"{version}\n".encode())
    return path


def discard(path: str | os.PathLike) -> None:
    """Remove a staged (never sealed) version directory."""
    shutil.rmtree(path, ignore_errors=True)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
