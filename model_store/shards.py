"""Embedding shard dumps on disk (the PS writes and reads them; the model store holds them): full dumps and deltas, verified loading and re-sharding.

A dump of shard i of n is one directory ``shard-<i>-of-<n>/``::

    signs.npy            uint64 (rows,)            the keys, in slot order
    rows.npy             float32|float16 (rows, dim)
    state.<name>.npy     float32 (rows, dim)       one per optimizer state (Adagrad: state.sum)
    stamp.npy, count.npy uint32 (rows,)            last-touch time (unix s) and touch count
    deleted.npy          uint64 (k,)               deltas only: signs deleted since the last cut
    buckets.npy          uint32 (2**bits + 1,)     full dumps only: the bucket directory (below)
    meta.json            format, kind (full|delta), shard, num_shards, dim, dtype, optimizer,
                         state names, schema_hash, rows, deleted, version, delta_seq, step, ...
    MANIFEST.json        sha256 and size of every file above
    _SUCCESS             written last

A full dump is written in *bucket order*: rows sorted by ``table_hash(sign)``, whose top
``bucket_bits`` bits (meta) are the sign's bucket, and ``buckets[b]:buckets[b + 1]`` are the slots
of bucket b (4 to 8 signs on average). That order plus the directory is a static hash index: a
serving PS maps the files read-only and looks signs up in place (serving/ps/table.py), at about
0.5-1 byte of index per row and no build step. Training stores read any order.

The directory is written under a hidden temporary name and renamed into place, so a reader sees
a complete dump or nothing. Loading checks ``_SUCCESS``, every checksum and the metadata against
the store before anything is installed. Arrays are plain ``.npy`` files, read with one read each.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from features.hashing import mix64, shard_of, unique_signs
from model_store.errors import StoreError
from model_store.layout import fsync_dir

__all__ = ["ShardData", "StoreError", "read_shard", "write_shard", "read_for_shard", "shard_dirs"]

FORMAT = "recserve-ps-shard/1"
SUCCESS = "_SUCCESS"
MANIFEST = "MANIFEST.json"
META = "meta.json"
_SHARD_RE = re.compile(r"^shard-(\d+)-of-(\d+)$")
TABLE_SALT = np.uint64(0x5DEECE66DA3B9F17)  # == serving.ps.index's salt; the numba twin is table._hash
XXH3 = "xxh3_128"  # a shard file's fast checksum in its MANIFEST.json (older dumps: sha256 only)
_CHUNK_ROWS = 1 << 18  # rows gathered per write of a bucket-ordered dump (16 MB of dim-16 rows)


def table_hash(signs: np.ndarray) -> np.ndarray:
    """The hash whose top bits bucket a sign in a full dump (vectorised)."""
    return mix64(np.asarray(signs, dtype=np.uint64) ^ TABLE_SALT)


def bucket_bits(rows: int) -> int:
    """Directory size for ``rows`` signs: 2**bits buckets of 4 to 8 signs on average."""
    return max(1, (rows // 8).bit_length())


def bucket_layout(signs: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """(order, directory, bits): ``signs[order]`` is bucket order and ``directory`` its offsets."""
    bits = bucket_bits(len(signs))
    h = table_hash(signs)
    order = np.argsort(h)
    h.sort()  # in place: 16 bytes a row at the peak (a dump of a live shard is written from views)
    starts = np.arange(1 << bits, dtype=np.uint64) << np.uint64(64 - bits)  # bucket b: [b, b + 1) << shift
    directory = np.empty((1 << bits) + 1, dtype=np.uint32)
    directory[:-1] = np.searchsorted(h, starts)
    directory[-1] = len(h)
    return order, directory, bits


@dataclass
class ShardData:
    """The arrays of one shard (full dump or delta) and its metadata."""

    meta: dict
    signs: np.ndarray
    rows: np.ndarray
    state: dict[str, np.ndarray]
    stamp: np.ndarray
    count: np.ndarray
    deleted: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint64))

    def select(self, mask: np.ndarray) -> ShardData:
        """The rows where ``mask`` is true (deleted signs are kept as they are)."""
        return ShardData(
            self.meta,
            self.signs[mask],
            self.rows[mask],
            {k: v[mask] for k, v in self.state.items()},
            self.stamp[mask],
            self.count[mask],
            self.deleted,
        )


def shard_dir_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard}-of-{num_shards}"


class _HashingWriter:
    """A write-only file wrapper that hashes what passes through (np.save writes through it)
    with XXH3-128, the checksum a reader checks (``checksum_ok``): 15 GB/s on one core against
    sha256's 1.5, so a 50M-row version's shard is checked in ~0.1 s, not 1.2 s of a core taken
    from lookups. Dumps written before it carry sha256, which still verifies.

    Bytes reach the file in whole ``BLOCK``s at ``BLOCK``-aligned offsets (the rest at
    ``close``): the page cache then holds a fresh dump in 2 MB folios, which a serving PS maps
    with 2 MB page-table entries. Gathered 2 MB pieces after the 128-byte npy header left
    ``signs.npy`` entirely in 4 KB pages (16 MB pieces: 87%)."""

    BLOCK = 16 << 20

    def __init__(self, f):
        import xxhash

        self.f = f
        self.xxh = xxhash.xxh3_128()
        self.size = 0
        self.pending = bytearray()

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        n = len(view)
        self.xxh.update(view)
        self.size += n
        if self.pending:  # top up the block begun by earlier writes
            k = min(n, self.BLOCK - len(self.pending))
            self.pending += view[:k]
            view = view[k:]
            if len(self.pending) < self.BLOCK:
                return n
            self._write(self.pending)
            self.pending = bytearray()
        whole = len(view) - len(view) % self.BLOCK
        if whole:  # aligned now: whole blocks straight from the caller's buffer
            self._write(view[:whole])
        self.pending += view[whole:]
        return n

    def close(self) -> None:
        self._write(self.pending)
        self.pending = bytearray()

    def _write(self, b) -> None:
        with memoryview(b) as view:
            while view:
                view = view[self.f.write(view) :]


def _write_file(path: Path, writer) -> dict:
    with open(path, "wb", buffering=0) as f:
        hw = _HashingWriter(f)
        writer(hw)
        hw.close()
        os.fsync(f.fileno())
    return {XXH3: hw.xxh.hexdigest(), "bytes": hw.size}


def _npy_writer(arr: np.ndarray, order: np.ndarray | None = None):
    """Writes ``arr`` (or ``arr[order]``, gathered a chunk at a time: no full permuted copy)."""
    if order is None:
        return lambda f: np.lib.format.write_array(f, np.ascontiguousarray(arr), allow_pickle=False)

    def write(f):
        np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(arr))
        for i in range(0, len(order), _CHUNK_ROWS):
            f.write(memoryview(np.ascontiguousarray(arr.take(order[i : i + _CHUNK_ROWS], axis=0))).cast("B"))

    return write


def write_shard(parent: str | os.PathLike, data: ShardData) -> Path:
    """Write ``data`` as ``parent/shard-<i>-of-<n>/`` (temporary name, fsync, rename); an
    existing dump of the same name is replaced. Returns the final path."""
    meta = dict(data.meta)
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    final = parent / shard_dir_name(meta["shard"], meta["num_shards"])
    tmp = parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        arrays = {
            "signs.npy": data.signs,
            "rows.npy": data.rows,
            "stamp.npy": data.stamp,
            "count.npy": data.count,
        }
        arrays.update({f"state.{k}.npy": v for k, v in data.state.items()})
        order = None
        if meta["kind"] == "delta":
            arrays["deleted.npy"] = data.deleted
        else:
            order, directory, meta["bucket_bits"] = bucket_layout(data.signs)
        files = {name: _write_file(tmp / name, _npy_writer(arr, order)) for name, arr in arrays.items()}
        if order is not None:
            files["buckets.npy"] = _write_file(tmp / "buckets.npy", _npy_writer(directory))
        meta.update(format=FORMAT, rows=int(len(data.signs)), deleted=int(len(data.deleted)))
        body = json.dumps(meta, indent=1, sort_keys=True).encode()
        files[META] = _write_file(tmp / META, lambda f: f.write(body))
        manifest = json.dumps({"files": files}, indent=1, sort_keys=True).encode()
        _write_file(tmp / MANIFEST, lambda f: f.write(manifest))
        _write_file(tmp / SUCCESS, lambda f: f.write(b""))
        fsync_dir(tmp)
        if final.exists():
            trash = parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def npy_header(path: Path, head: bytes) -> tuple[tuple, np.dtype, int]:
    """(shape, dtype, data offset) of a .npy file from its first bytes; StoreError if it is not a
    plain C-order array."""
    bio = io.BytesIO(head)
    try:
        version = np.lib.format.read_magic(bio)
        read = (
            np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        )
        shape, fortran, dtype = read(bio)
    except ValueError as e:
        raise StoreError(f"{path}: not a .npy array: {e}") from e
    if fortran or dtype.hasobject:
        raise StoreError(f"{path}: unsupported array layout")
    return shape, dtype, bio.tell()


VERIFY_DUTY = 0.5
"""Share of its time a serving PS's checksum pass over a version it is about to flip to is busy:
it hashes a 4 MB piece, then sleeps as long again. At full speed the pass took the memory
bandwidth the lookups on the other core need (their p99 while it ran: about 2x steady)."""


def checksum_ok(buf, expect: dict, duty: float = 1.0, chunk: int = 4 << 20) -> bool:
    """Whether a shard file's bytes match its manifest entry: XXH3-128 where the dump has it,
    else sha256. ``duty`` 1 hashes in one call (no GIL held meanwhile); below 1 the pass goes in
    ``chunk``-byte pieces paced to ``duty`` (``VERIFY_DUTY``: a serving PS's pass)."""
    if XXH3 in expect:
        import xxhash

        h, want = xxhash.xxh3_128(), expect[XXH3]
    else:
        h, want = hashlib.sha256(), expect["sha256"]
    if duty >= 1:
        h.update(buf)
        return h.hexdigest() == want
    rest = 1 / max(duty, 0.01) - 1  # seconds asleep per second busy
    with memoryview(buf) as view, view.cast("B") as flat:
        for i in range(0, len(flat), chunk):
            t = time.perf_counter()
            h.update(flat[i : i + chunk])
            time.sleep((time.perf_counter() - t) * rest)
    return h.hexdigest() == want


def _read_npy(path: Path, expect: dict) -> np.ndarray:
    """One read, checksum over the bytes, then an array view of them (no second copy)."""
    buf = bytearray(path.read_bytes())
    if len(buf) != expect.get("bytes", len(buf)) or not checksum_ok(buf, expect):
        raise StoreError(f"{path}: checksum mismatch (file corrupt or modified after the dump)")
    shape, dtype, offset = npy_header(path, bytes(buf[: 1 << 16]))
    return np.frombuffer(buf, dtype=dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)


def read_listing(path: Path) -> tuple[dict, dict]:
    """(manifest files, meta) of a complete shard directory, meta checked against its sha256."""
    if not (path / SUCCESS).is_file():
        raise StoreError(f"{path}: no {SUCCESS} marker: the dump is incomplete or still being written")
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        raise StoreError(f"{path}: unreadable {MANIFEST}: {e}") from e
    if META not in files:
        raise StoreError(f"{path}: {MANIFEST} does not list {META}")
    body = (path / META).read_bytes()
    if not checksum_ok(body, files[META]):
        raise StoreError(f"{path / META}: checksum mismatch")
    meta = json.loads(body)
    if meta.get("format") != FORMAT:
        raise StoreError(f"{path}: unknown dump format {meta.get('format')!r}, expected {FORMAT!r}")
    return files, meta


def read_shard(path: str | os.PathLike) -> ShardData:
    """Read and verify one shard directory (full or delta)."""
    path = Path(path)
    files, meta = read_listing(path)
    arrays = {}
    for name, info in files.items():
        if name.endswith(".npy"):
            if not (path / name).is_file():
                raise StoreError(f"{path}: {name} listed in {MANIFEST} is missing")
            arrays[name] = _read_npy(path / name, info)
    data = ShardData(
        meta=meta,
        signs=arrays.get("signs.npy"),
        rows=arrays.get("rows.npy"),
        state={n: arrays.get(f"state.{n}.npy") for n in meta["state"]},
        stamp=arrays.get("stamp.npy"),
        count=arrays.get("count.npy"),
        deleted=arrays.get("deleted.npy", np.empty(0, np.uint64)),
    )
    _validate(path, data)
    return data


def _validate(path: Path, d: ShardData) -> None:
    n, dim = d.meta["rows"], d.meta["dim"]
    checks = [
        ("signs", d.signs, (n,), np.uint64),
        ("rows", d.rows, (n, dim), np.dtype(d.meta["dtype"])),
        ("stamp", d.stamp, (n,), np.uint32),
        ("count", d.count, (n,), np.uint32),
        ("deleted", d.deleted, (d.meta["deleted"],), np.uint64),
    ] + [(f"state.{k}", v, (n, dim), np.float32) for k, v in d.state.items()]
    for name, arr, shape, dtype in checks:
        if arr is None:
            raise StoreError(f"{path}: {name}.npy is missing")
        if arr.shape != shape or arr.dtype != dtype:
            raise StoreError(
                f"{path}: {name}.npy is {arr.dtype}{arr.shape}, meta.json says {np.dtype(dtype)}{shape}"
            )


def check_compatible(meta: dict, dim: int, dtype: str, schema_hash: str, where: str = "") -> None:
    """Refuse a dump whose dim, row dtype or feature-schema hash differs from the store's."""
    where = where or f"shard {meta.get('shard')} of {meta.get('num_shards')}"
    if meta["dim"] != dim:
        raise StoreError(f"{where}: dim {meta['dim']} does not match the store's dim {dim}")
    if meta["dtype"] != dtype:
        raise StoreError(f"{where}: dtype {meta['dtype']} does not match the store's dtype {dtype}")
    if schema_hash and meta.get("schema_hash", "") != schema_hash:
        raise StoreError(
            f"{where}: schema hash {meta.get('schema_hash', '')!r} does not match the store's {schema_hash!r} "
            "(the dump was trained with another feature schema)"
        )


def shard_dirs(paths: str | os.PathLike | Sequence[str | os.PathLike]) -> list[Path]:
    """The shard directories named by ``paths``: a shard directory itself, a directory holding
    ``shard-<i>-of-<n>/`` directories (all n must be there), or a list of shard directories."""
    if isinstance(paths, (str, os.PathLike)):
        root = Path(paths)
        if (root / META).exists() or _SHARD_RE.match(root.name):  # not _SUCCESS: a delta dir has its own
            return [root]
        if not root.is_dir():
            raise StoreError(f"{root}: no such dump directory")
        found = sorted(p for p in root.iterdir() if _SHARD_RE.match(p.name))
        if not found:
            raise StoreError(f"{root}: no shard-<i>-of-<n> directories in it")
        counts = {int(_SHARD_RE.match(p.name).group(2)) for p in found}
        if len(counts) != 1:
            raise StoreError(f"{root}: dumps of different shard counts {sorted(counts)} side by side")
        n = counts.pop()
        have = {int(_SHARD_RE.match(p.name).group(1)) for p in found}
        missing = sorted(set(range(n)) - have)
        if missing:
            raise StoreError(f"{root}: shards {missing} of {n} are missing")
        return [root / shard_dir_name(i, n) for i in range(n)]
    return [Path(p) for p in paths]


def read_meta(shard_dir: Path) -> dict:
    """A shard directory's meta.json, unverified (to decide how to read it; readers verify)."""
    try:
        return json.loads((Path(shard_dir) / META).read_text())
    except (OSError, ValueError) as e:
        raise StoreError(f"{shard_dir}: unreadable {META}: {e}") from e


def read_for_shard(paths, shard: int, num_shards: int, check=None) -> ShardData:
    """The part of a dump (full or delta, any shard count) that shard ``shard`` of
    ``num_shards`` owns, by the routing hash. ``check(meta, where)`` vets each shard's metadata
    before its arrays are read."""
    dirs = shard_dirs(paths)
    metas = [read_meta(d) for d in dirs]
    if check is not None:
        for d, m in zip(dirs, metas, strict=True):
            check(m, str(d))
    same = [
        d for d, m in zip(dirs, metas, strict=True) if (m["shard"], m["num_shards"]) == (shard, num_shards)
    ]
    if same and all(m["num_shards"] == num_shards for m in metas) and len(dirs) == num_shards:
        return read_shard(same[0])  # same layout: read only our own shard
    parts = []
    for d in dirs:
        data = read_shard(d)
        if data.meta["num_shards"] == num_shards and data.meta["shard"] == shard:
            parts.append(data)
        else:
            parts.append(data.select(shard_of(data.signs, num_shards) == shard))
    return _concat(parts)


def _concat(parts: Iterable[ShardData]) -> ShardData:
    parts = list(parts)
    if len(parts) == 1:
        return parts[0]
    meta = dict(parts[0].meta)
    for key in ("kind", "dim", "dtype", "optimizer", "delta_seq", "version"):
        values = {str(p.meta.get(key)) for p in parts}
        if len(values) > 1:
            raise StoreError(f"shard dumps disagree on {key}: {sorted(values)}")
    meta["step"] = max(int(p.meta.get("step", 0)) for p in parts)
    return ShardData(
        meta=meta,
        signs=np.concatenate([p.signs for p in parts]),
        rows=np.concatenate([p.rows for p in parts]),
        state={k: np.concatenate([p.state[k] for p in parts]) for k in parts[0].state},
        stamp=np.concatenate([p.stamp for p in parts]),
        count=np.concatenate([p.count for p in parts]),
        deleted=unique_signs(np.concatenate([p.deleted for p in parts])),
    )
