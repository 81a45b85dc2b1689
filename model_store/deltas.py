"""A delta's ``DELTA.json``: what a continuous trainer had consumed when it cut the delta, the
typed record ``DeltaManifest`` with its one writer and one reader.

Written into ``deltas/<seq>/`` after the shards' deltas and before the delta's ``_SUCCESS``, so a
published delta always has it (deltas cut before it existed have none: ``read_delta`` gives
None). ``positions`` are the source's units and where each resumes (a stream's partitions and
their next offsets; a watched directory's files and rows), taken when the delta was cut: every
record before them is in this delta or an earlier one, none after. ``keys`` names the file (in the
delta directory, digest recorded) of the (request, item) keys trained over the dedupe window, so
a restarted trainer drops a re-emitted sample it already trained. A full version written from the
stream carries the same record in ``stream/`` (where its first delta would start).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from model_store.errors import CorruptVersion, RecordError
from model_store.layout import write_atomic
from model_store.records import decode

FORMAT = "recserve-delta/1"
NAME = "DELTA.json"
KEYS = "trained_keys.npz"
STREAM = "stream"
"""Where in a full version written from the stream its own record lies (the same format)."""


@dataclass
class DeltaManifest:
    """Where a continuous trainer stood when it cut one delta."""

    source: str
    """The source spec it trained from (``kafka://BROKERS/TOPIC``, ``watch://DIR``)."""
    positions: dict[str, int] = field(default_factory=dict)
    """Unit (``<topic>/<partition>``, a file's name) -> the row or offset it resumes at."""
    samples: int = 0
    """Rows trained into this delta."""
    duplicates: int = 0
    """Rows dropped since the last delta because their key was trained already."""
    auc: float | None = None
    """Progressive AUC of the samples trained into it, each scored before it trained (None: none,
    or one class only)."""
    logloss: float | None = None
    keys: str = ""
    """The trained-keys file in the delta directory ('' : none, the source has no keys)."""
    keys_digest: str = ""
    keys_count: int = 0
    format: str = FORMAT
    created: float = 0.0


def write_delta(directory: str | os.PathLike[str], record: DeltaManifest,
                keys: tuple[NDArray[np.bytes_], NDArray[np.float64]] | None = None) -> DeltaManifest:  # fmt: skip
    """Write ``DELTA.json`` (and the trained keys with their times) into a delta directory that
    has no ``_SUCCESS`` yet; returns the record written."""
    from model_store.manifest import file_digest

    d = Path(directory)
    record = replace(record, format=FORMAT, created=time.time())
    if keys is not None:
        with open(d / KEYS, "wb") as f:
            np.savez(f, keys=keys[0], ts=keys[1])
            f.flush()
            os.fsync(f.fileno())
        record = replace(record, keys=KEYS, keys_digest=file_digest(d / KEYS), keys_count=len(keys[0]))
    write_atomic(d / NAME, json.dumps(asdict(record), indent=1, sort_keys=True).encode())
    return record


def read_delta(directory: str | os.PathLike[str]) -> DeltaManifest | None:
    """The record of a delta directory (None: a delta cut without one); RecordError when it
    cannot be read as one."""
    path = Path(directory) / NAME
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise RecordError(f"{path}: unreadable delta record: {e}") from None
    return decode(DeltaManifest, raw, "delta record", str(path))


def read_keys(directory: str | os.PathLike[str], record: DeltaManifest) -> tuple[NDArray[np.bytes_], NDArray[np.float64]]:  # fmt: skip
    """The trained keys and their times the record names, verified against its digest."""
    from model_store.manifest import digest_ok

    d = Path(directory)
    if not record.keys:
        return np.zeros(0, "S1"), np.zeros(0, np.float64)
    path = d / record.keys
    if not path.is_file() or not digest_ok(path, record.keys_digest):
        raise CorruptVersion(f"{path}: missing or fails its checksum in {NAME}")
    with np.load(path, allow_pickle=False) as z:
        keys, ts = z["keys"], z["ts"]
    if len(keys) != record.keys_count or len(ts) != len(keys):
        raise CorruptVersion(f"{path}: {len(keys)} keys, {NAME} says {record.keys_count}")
    return keys, ts


def last_record(version_dir: str | os.PathLike[str]) -> tuple[DeltaManifest, Path] | None:
    """The record of the version's newest complete delta and its directory; for a version with no
    delta, the record it was written with (``stream/``: a full version from the stream, whose
    manifest lists the record's files). None: no record."""
    from model_store.layout import delta_dir, list_deltas

    seqs = list_deltas(version_dir)
    d = delta_dir(version_dir, seqs[-1]) if seqs else Path(version_dir) / STREAM
    record = read_delta(d)
    return None if record is None else (record, d)
