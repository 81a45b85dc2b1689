"""Version manifests: the typed record (``VersionManifest``), its one writer and one reader with
verification (a checksum of every file), with typed errors; and ``seal``, which marks a staged
version done and renames it into place.

``MANIFEST.json`` is ``VersionManifest`` as JSON: format, model, version, parent, created,
schema_fingerprint, model_config, dim, num_shards, dense paths, the measured dense runtime choice,
metrics, deltas, how it was trained, and ``"files": {relpath: digest}`` for every file of the
version but MANIFEST/_SUCCESS. A manifest of another ``format``, with a field missing, unknown or
of the wrong type is refused (``UnknownFormat``, ``RecordError``: both ``CorruptVersion``). A
digest is ``xxh3_128:<hex>`` (XXH3-128: ~10 GB/s with the reads, so ``recserve publish`` checks a
4 GB version in well under a second instead of 2.7 s of a core next to the lookups it serves) or,
in manifests written before it, a plain sha256 hex; both verify. Files under ``deltas/`` that are
not listed are allowed: deltas cut after the version was sealed carry their own per-shard
manifests and ``_SUCCESS``.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from model_store.errors import CorruptVersion, IncompleteVersion, ModelStoreError
from model_store.layout import DELTAS, FORMAT, MANIFEST, SUCCESS, fsync_dir, mark_done, write_atomic
from model_store.records import decode


def sha256_file(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """The file's sha256, read in ``chunk``-byte pieces into one reused buffer (reading and
    hashing both release the GIL; ~1.5 GB/s on one core with SHA extensions)."""
    h = hashlib.sha256()
    view = memoryview(bytearray(chunk))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


XXH3_PREFIX = "xxh3_128:"


def file_digest(path: str | os.PathLike[str], chunk: int = 1 << 20) -> str:
    """The manifest digest of a file: ``xxh3_128:<hex>``, read into one reused buffer."""
    import xxhash

    h = xxhash.xxh3_128()
    view = memoryview(bytearray(chunk))
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return XXH3_PREFIX + h.hexdigest()


def digest_ok(path: str | os.PathLike[str], recorded: str) -> bool:
    """Whether the file matches its manifest digest (XXH3-128, or sha256 in older manifests)."""
    if recorded.startswith(XXH3_PREFIX):
        return file_digest(path) == recorded
    return sha256_file(path) == recorded


def file_checksums(directory: str | os.PathLike[str]) -> dict[str, str]:
    """The digest of every file under ``directory`` (posix relpaths) except the top MANIFEST/_SUCCESS."""
    root = Path(directory)
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel not in (MANIFEST, SUCCESS):
            out[rel] = file_digest(p)
    return out


@dataclass
class RuntimeChoice:
    """The dense runtime the export measured faster, and the figures it chose by."""

    default: str
    """What ``--runtime auto`` serves."""
    p50_ms: dict[str, float] = field(default_factory=dict)
    """Runtime -> p50 latency of one request-sized batch."""
    rows: int = 0
    """Rows of the timed batch."""
    threads: int = 1
    """Intra-op threads it was timed with."""


@dataclass
class QuantRecord:
    """What serving a version's tables in a reduced-precision dtype costs, measured by its export:
    the test split scored with the served (dequantized) rows and with the trained float32 rows."""

    dtype: str
    """The serving dtype (float16 or int8: ``model_store.quant``)."""
    float32_auc: float
    """Test AUC with the float32 rows (the trainer's own scores)."""
    auc: float
    """Test AUC with the rows as served."""
    max_abs_score_diff: float
    """Largest |probability difference| of one test row between the two."""
    rows: int = 0
    """Test rows scored."""

    @property
    def auc_drop(self) -> float:
        return self.float32_auc - self.auc


@dataclass
class StreamRecord:
    """How a full version written by a streaming trainer (``--full-every``) was judged: the
    samples of its latest window, each scored by the candidate and by the version serving then,
    before it trained (progressive validation). Where the stream resumes from it (offsets and
    trained keys) is its ``stream/DELTA.json`` (``model_store.deltas``)."""

    served_version: str
    """The version serving when it was written (the one it is judged against)."""
    samples: int
    """Samples of the window."""
    auc: float | None
    """The candidate's progressive AUC on them (None: no samples, or one class only)."""
    served_auc: float | None
    """The served version's progressive AUC on the same samples."""

    @property
    def auc_drop(self) -> float | None:
        """How far the candidate's AUC is below the served one's (None: not measurable)."""
        return None if self.auc is None or self.served_auc is None else self.served_auc - self.auc


@dataclass
class TrainRecord:
    """How a version was trained (``recserve train``)."""

    config: dict[str, Any]
    """The trainer's configuration (``TrainConfig`` as a dict)."""
    world_size: int = 1
    steps: int = 0
    plan: dict[str, Any] | None = None
    """The sharding plan it trained with (``training.planning.plan.ShardingPlan`` as a dict)."""


@dataclass
class VersionManifest:
    """A version's ``MANIFEST.json``: what it is, what it holds, and every file's digest."""

    model: str
    version: str
    schema_fingerprint: str
    """The feature schema's fingerprint (``features.schema.Schema.fingerprint``)."""
    dim: int
    """Embedding dimension of every shard."""
    num_shards: int
    """Shards the embedding dumps were written as (any PS count re-shards them)."""
    format: int = FORMAT
    created: float = 0.0
    """When it was written (time.time(); ``write_manifest`` sets it)."""
    parent: str | None = None
    """The newest version that existed when it was exported."""
    model_config: dict[str, Any] = field(default_factory=dict)
    """The dense network's configuration (``training.models.ModelConfig`` as a dict, with the fitted
    dense statistics)."""
    dense: dict[str, str] = field(default_factory=dict)
    """Dense runtime -> its file, relative to the version."""
    dense_runtime: RuntimeChoice | None = None
    """The export's measured choice (None: exported before it was measured: torchscript)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """The trainer's test metrics (auc, logloss, ...)."""
    deltas: int = 0
    """Deltas cut into it before it was sealed."""
    train: TrainRecord | None = None
    quantized: QuantRecord | None = None
    """The export's check of a version served in float16 or int8 (None: served in float32)."""
    stream: StreamRecord | None = None
    """A full version from the stream: what the gate judges it by (None: not from the stream)."""
    files: dict[str, str] = field(default_factory=dict)
    """Relpath -> digest of every file but MANIFEST/_SUCCESS (``write_manifest`` fills it)."""

    @property
    def num_slots(self) -> int | None:
        """Sparse slots the dense network takes (None: not recorded)."""
        return self.model_config.get("num_slots")

    @property
    def num_dense(self) -> int | None:
        """Dense inputs the dense network takes (None: not recorded)."""
        return self.model_config.get("num_dense")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = MANIFEST) -> VersionManifest:
        """The manifest in ``text``; RecordError (UnknownFormat for another format) naming ``where``."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise CorruptVersion(f"{where}: cannot read {MANIFEST}: {e}") from None
        return decode(cls, raw, "version manifest", where)


def write_manifest(directory: str | os.PathLike[str], manifest: VersionManifest) -> VersionManifest:
    """Write MANIFEST.json with ``created`` and the checksums of every file now in ``directory``
    filled in; returns the manifest written."""
    directory = Path(directory)
    full = replace(manifest, format=FORMAT, created=time.time(), files=file_checksums(directory))
    write_atomic(directory / MANIFEST, full.to_json().encode())
    return full


def seal(staging: str | os.PathLike[str], final: str | os.PathLike[str]) -> Path:
    """Write ``_SUCCESS`` into a staged version and rename it to its final name."""
    staging, final = Path(staging), Path(final)
    if final.exists():
        raise ModelStoreError(f"{final} already exists")
    mark_done(staging)
    os.replace(staging, final)
    fsync_dir(final.parent)
    return final


def read_manifest(directory: str | os.PathLike[str], verify: bool = True) -> VersionManifest:
    """The manifest of a complete version; raises IncompleteVersion where ``_SUCCESS`` is
    missing, CorruptVersion where the manifest is unreadable or not a valid record (RecordError,
    UnknownFormat) or (``verify``) a file is missing, unlisted or fails its checksum."""
    d = Path(directory)
    if not (d / SUCCESS).is_file():
        raise IncompleteVersion(f"{d}: no {SUCCESS}: the version is incomplete, refusing it")
    try:
        text = (d / MANIFEST).read_text()
    except OSError as e:
        raise CorruptVersion(f"{d}: cannot read {MANIFEST}: {e}") from None
    manifest = VersionManifest.from_json(text, str(d / MANIFEST))
    if verify:
        listed = manifest.files
        present = {p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file()} - {MANIFEST, SUCCESS}
        missing = sorted(set(listed) - present)
        if missing:
            raise CorruptVersion(f"{d}: files in the manifest are missing: {missing[:5]}")
        extra = sorted(p for p in present - set(listed) if not p.startswith(DELTAS + "/"))
        if extra:
            raise CorruptVersion(f"{d}: files not in the manifest: {extra[:5]}")
        for rel, digest in listed.items():
            if not digest_ok(d / rel, digest):
                raise CorruptVersion(f"{d}: checksum mismatch for {rel}")
    return manifest


def verify_files(directory: str | os.PathLike[str], manifest: VersionManifest, names: list[str]) -> None:
    """Check the checksums of just the listed files a reader is about to use (a handler needs the
    dense model and schema, not every embedding shard; PS shard dumps carry their own checksums)."""
    d = Path(directory)
    listed = manifest.files
    for rel in names:
        if rel not in listed:
            raise CorruptVersion(f"{d}: {rel} is not in the manifest")
        if not (d / rel).is_file() or not digest_ok(d / rel, listed[rel]):
            raise CorruptVersion(f"{d}: checksum mismatch for {rel}")
