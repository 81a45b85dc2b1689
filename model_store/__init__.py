"""The model store: the artifact format and its life cycle.

- ``layout``: paths, version numbering, staging, deltas, CURRENT, atomic writes, and the one
  writer of ``_SUCCESS`` (``mark_done``);
- ``manifest``: MANIFEST.json as a typed record (``VersionManifest``), write/read/verify (a checksum of every file: XXH3-128, or sha256),
  and ``seal`` (mark a staged version done, rename it into place);
- ``errors``: typed errors (VersionNotFound, IncompleteVersion, CorruptVersion, IncompatibleVersion,
  SchemaMismatch, StoreError, CapacityError, RecordError, UnknownFormat);
- ``records``: the one decoder of the typed, versioned JSON records (manifest, shard meta);
- ``releases``: THE gate (``validate``), THE publish (CURRENT + HISTORY), rollback, retention;
- ``shards``: the embedding shard dump format (full dumps and deltas), verified reads, re-sharding;
  ``shardfile``: one file of a dump, written with its checksum and read back verified;
- ``runtimes``: the dense runtimes (TorchScript, ONNX), one module each, and their registry;
  ``dense``: which runtime serves a version, its timing, and the loader serving uses.

Artifacts live under a root directory outside the source tree (``default_root()``:
``$RECSERVE_STORE`` or ``./artifacts``). ``import model_store as ms`` gives the common API below.
"""

from model_store.errors import (
    CapacityError,
    CorruptVersion,
    IncompatibleVersion,
    IncompleteVersion,
    ModelStoreError,
    QualityDrop,
    QuantizationLoss,
    RecordError,
    SchemaMismatch,
    StoreError,
    UnknownFormat,
    VersionNotFound,
)
from model_store.layout import (
    CURRENT,
    DELTAS,
    MANIFEST,
    SUCCESS,
    current,
    default_root,
    delta_dir,
    discard,
    fsync_dir,
    list_deltas,
    mark_done,
    model_dir,
    next_version,
    staging_dir,
    version_dir,
    versions,
    write_atomic,
)
from model_store.manifest import (
    QuantRecord,
    RuntimeChoice,
    StreamRecord,
    TrainRecord,
    VersionManifest,
    file_digest,
    read_manifest,
    seal,
    sha256_file,
    verify_files,
    write_manifest,
)
from model_store.releases import (
    current_manifest,
    history,
    list_versions,
    publish,
    refusals,
    rollback,
    validate,
)
from model_store.retention import doomed, pin, pins, retain, unpin

__all__ = [
    "CURRENT", "DELTAS", "MANIFEST", "SUCCESS", "CapacityError", "CorruptVersion", "IncompatibleVersion",
    "IncompleteVersion",
    "ModelStoreError", "RecordError", "RuntimeChoice", "SchemaMismatch", "StoreError", "TrainRecord", "QuantRecord", "QuantizationLoss", "QualityDrop", "StreamRecord",
    "UnknownFormat", "VersionManifest", "VersionNotFound", "current", "default_root",
    "current_manifest", "delta_dir", "discard", "fsync_dir",
    "doomed", "history", "list_deltas", "list_versions", "mark_done", "model_dir", "next_version", "publish",
    "pin", "pins", "read_manifest", "refusals", "retain", "unpin", "rollback", "seal", "file_digest", "sha256_file", "staging_dir", "validate",
    "verify_files", "version_dir", "versions", "write_atomic", "write_manifest",
]  # fmt: skip
