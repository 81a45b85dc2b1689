"""A delta's ``DELTA.json``: what a continuous trainer had consumed when it cut the delta, the
typed record ``DeltaManifest`` with its one writer and one reader.

Written into ``deltas/<seq>/`` after the shards' deltas and before the delta's ``_SUCCESS``, so a
published delta always has it (deltas cut before it existed have none: ``read_delta`` gives
None). ``positions`` are the source's units and where each resumes (a stream's partitions and
their next offsets; a watched directory's files and rows), taken when the delta was cut: every
record before them is in this delta or an earlier one, none after. ``keys`` names the file (in the
delta directory, digest recorded) of the (request, item) keys trained, so a restarted trainer
drops a re-emitted sample it already trained. A full version written from the stream carries the
same record in ``stream/`` (where its first delta would start).

Key files are incremental (format 2): a file holds the whole dedupe window (``keys_after`` '') or
only the keys trained since the record at ``keys_after`` (a path relative to this record's
directory: ``../<seq>``, ``../../stream``), whose window it adds to. ``read_keys`` walks back to the
whole-window file and keeps the keys of the window as of this record (times >= ``keys_since``),
each once. A delta every 0.5 s at 1.5M keys in the window cannot rewrite them all (68 MiB); the
writer (``training.follow.book``) decides when a whole-window file is due. Format 1 records
(every key file whole) are still read.
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

FORMAT = "recserve-delta/2"
FORMATS = (FORMAT, "recserve-delta/1")
"""What ``read_delta`` reads: 1 had whole-window key files only (no ``keys_after``...)."""
MAX_LINKS = 100_000
"""A chain of key files longer than this is refused (a cycle, a broken writer)."""
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
    """Keys in this record's file."""
    keys_after: str = ""
    """'' : the file holds the whole window; else the record (its directory, relative to this
    one) whose window this file's keys are added to."""
    keys_since: float | None = None
    """The window's start as of this record: keys trained at an earlier time are out of it (None:
    every key read is in)."""
    keys_links: int = 0
    """Files added since the last whole-window one, this one included (0: this one is whole)."""
    keys_added: int = 0
    """Keys in those files."""
    format: str = FORMAT
    created: float = 0.0


def write_delta(directory: str | os.PathLike[str], record: DeltaManifest,
                keys: tuple[NDArray[np.bytes_], NDArray[np.float64]] | None = None) -> DeltaManifest:  # fmt: skip
    """Write ``DELTA.json`` (and the trained keys with their times: the window's, or those added
    after ``record.keys_after``) into a delta directory that has no ``_SUCCESS`` yet; returns the
    record written."""
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
    return decode(DeltaManifest, raw, "delta record", str(path), FORMATS)


def read_keys(directory: str | os.PathLike[str], record: DeltaManifest) -> tuple[NDArray[np.bytes_], NDArray[np.float64]]:  # fmt: skip
    """The trained keys of the window as of the record, sorted, each once with its latest time:
    its file's and those of the records it adds to, back to a whole-window file, each verified
    against its digest."""
    d, r, parts = Path(directory), record, []
    while True:
        parts.append(_key_file(d, r))
        if not r.keys_after:
            break
        if len(parts) > MAX_LINKS:
            raise CorruptVersion(f"{directory}: more than {MAX_LINKS} key files chained")
        d = d / r.keys_after
        prev = read_delta(d)
        if prev is None:
            raise CorruptVersion(f"{d}: the trained keys of {directory} add to this record, which is gone")
        r = prev
    keys, ts = parts[-1]  # the whole-window file: sorted, each key once
    if len(parts) > 1:
        keys, ts = _merge(keys, ts, *_latest(parts[-2::-1]))
    if record.keys_since is not None:
        keep = ts >= record.keys_since
        keys, ts = keys[keep], ts[keep]
    return keys, ts


def _latest(parts: list[tuple[NDArray[np.bytes_], NDArray[np.float64]]]) -> tuple[NDArray[np.bytes_], NDArray[np.float64]]:  # fmt: skip
    """The added files' keys (``parts`` oldest first), sorted, each once with its latest time (a key
    trained again after it left the window)."""
    keys, ts = np.concatenate([k for k, _ in parts]), np.concatenate([t for _, t in parts])
    order = np.argsort(keys, kind="stable")
    keys, ts = keys[order], ts[order]
    last = np.ones(len(keys), bool)
    last[:-1] = keys[1:] != keys[:-1]
    return keys[last], ts[last]


def _merge(keys: NDArray[np.bytes_], ts: NDArray[np.float64], add: NDArray[np.bytes_],
           add_ts: NDArray[np.float64]) -> tuple[NDArray[np.bytes_], NDArray[np.float64]]:  # fmt: skip
    """Sorted unique ``add`` into sorted unique ``keys`` (a binary search each, no sort of the
    window): a key in both takes ``add``'s later time."""
    width = max(keys.dtype.itemsize, add.dtype.itemsize)
    keys, add = keys.astype(f"S{width}", copy=False), add.astype(f"S{width}", copy=False)
    at = np.searchsorted(keys, add)
    hit = np.zeros(len(add), bool)
    inside = at < len(keys)
    hit[inside] = keys[at[inside]] == add[inside]
    ts = ts.copy()
    ts[at[hit]] = add_ts[hit]
    return np.insert(keys, at[~hit], add[~hit]), np.insert(ts, at[~hit], add_ts[~hit])


def _key_file(d: Path, record: DeltaManifest) -> tuple[NDArray[np.bytes_], NDArray[np.float64]]:
    """One record's own key file, verified."""
    from model_store.manifest import digest_ok

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
