"""Embedding shard dumps on disk (the PS writes and reads them; the model store holds them):
full dumps and deltas, verified loading and re-sharding.

A dump of shard i of n is one directory ``shard-<i>-of-<n>/``::

    signs.npy            uint64 (rows,)            the keys, in slot order
    rows.npy             float32|float16 (rows, dim), or uint8 codes in an int8 version
    qparams.npy          float16 (rows, 2)         int8 only: each row's scale and bias
    state.<name>.npy     float32 (rows, dim)       one per optimizer state (Adagrad: state.sum)
    stamp.npy, count.npy uint32 (rows,)            last-touch time (unix s) and touch count
    deleted.npy          uint64 (k,)               deltas only: signs deleted since the last cut
    buckets.npy          uint32 (2**bits + 1,)     full dumps only: the bucket directory (below)
    meta.json            ``model_store.meta.ShardMeta``: format, kind (full|delta), shard,
                         num_shards, the table's spec, state names, schema_hash, rows, deleted,
                         version, delta_seq, step, ...
    MANIFEST.json        XXH3-128 (older dumps: sha256) and size of every file above
    _SUCCESS             written last (``model_store.layout.mark_done``)

A full dump is written in *bucket order*: rows sorted by ``table_hash(sign)``, whose top
``bucket_bits`` bits (meta) are the sign's bucket, and ``buckets[b]:buckets[b + 1]`` are the slots
of bucket b (4 to 8 signs on average). That order plus the directory is a static hash index: a
serving PS maps the files read-only and looks signs up in place (serving/ps/table.py), at about
0.5-1 byte of index per row and no build step. Training stores read any order.

The directory is written under a hidden temporary name and renamed into place, so a reader sees
a complete dump or nothing. Loading checks ``_SUCCESS``, every checksum and the arrays against
meta.json before anything is installed. How one file is written, read and checked (one read
each, no second copy) is ``model_store.shardfile``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from features.hashing import TABLE_SALT, mix64, shard_of, unique_signs
from model_store.errors import StoreError
from model_store.layout import MANIFEST, SUCCESS, fsync_dir, mark_done
from model_store.meta import FORMAT, ShardMeta
from model_store.quant import row_codec
from model_store.shardfile import (
    VERIFY_DUTY,
    XXH3,
    FileEntry,
    checksum_ok,
    npy_header,
    npy_writer,
    read_npy,
    write_file,
)
from model_store.shardfile import HashingWriter as _HashingWriter  # its old name here, which tests patch

__all__ = [
    "FORMAT", "MANIFEST", "META", "SUCCESS", "VERIFY_DUTY", "XXH3", "ShardData",
    "bucket_bits",
    "bucket_layout", "check_compatible", "checksum_ok", "npy_header", "read_for_shard", "read_listing",
    "read_meta", "read_shard", "shard_dir_name", "shard_dirs", "table_hash", "write_shard", "_HashingWriter",
    "encode_delta", "encode_dump",
]  # fmt: skip

META = "meta.json"
_SHARD_RE = re.compile(r"^shard-(\d+)-of-(\d+)$")

PathLike = str | os.PathLike[str]


def table_hash(signs: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """The hash whose top bits bucket a sign in a full dump (vectorised; ``serving.ps.index._hash``
    is its compiled twin for one sign)."""
    return mix64(np.asarray(signs, dtype=np.uint64) ^ TABLE_SALT)


def bucket_bits(rows: int) -> int:
    """Directory size for ``rows`` signs: 2**bits buckets of 4 to 8 signs on average."""
    return max(1, (rows // 8).bit_length())


def bucket_layout(signs: NDArray[np.uint64]) -> tuple[NDArray[np.intp], NDArray[np.uint32], int]:
    """(order, directory, bits): ``signs[order]`` is bucket order and ``directory`` its offsets."""
    bits = bucket_bits(len(signs))
    h = table_hash(signs)
    order = np.argsort(h)
    h.sort()  # in place: 16 bytes a row at the peak (a dump of a live shard is written from views)
    return order, bucket_directory(h, bits), bits


def bucket_directory(h: NDArray[np.uint64], bits: int) -> NDArray[np.uint32]:
    """The offsets of 2**bits buckets in the sorted table hashes ``h``."""
    starts = np.arange(1 << bits, dtype=np.uint64) << np.uint64(64 - bits)  # bucket b: [b, b + 1) << shift
    directory = np.empty((1 << bits) + 1, dtype=np.uint32)
    directory[:-1] = np.searchsorted(h, starts)
    directory[-1] = len(h)
    return directory


@dataclass
class ShardData:
    """The arrays of one shard (full dump or delta) and its metadata."""

    meta: ShardMeta
    signs: NDArray[np.uint64]
    rows: NDArray[Any]  # in meta.dtype's storage: float32 or float16, or int8's uint8 codes
    state: dict[str, NDArray[np.float32]]
    stamp: NDArray[np.uint32]
    count: NDArray[np.uint32]
    deleted: NDArray[np.uint64] = field(default_factory=lambda: np.empty(0, np.uint64))
    qparams: NDArray[np.float16] | None = None
    """A serving dtype with qparams (int8) only: each row's fp16 scale and bias (``model_store.quant``)."""

    @property
    def nbytes(self) -> int:
        """Bytes of all its arrays."""
        arrays = [self.signs, self.rows, self.stamp, self.count, self.deleted, *self.state.values()]
        return sum(a.nbytes for a in arrays) + (0 if self.qparams is None else self.qparams.nbytes)

    def encoded(self, dtype: str) -> ShardData:
        """These (float32) rows in serving dtype ``dtype`` (its codec's ``encode``: int8 quantized
        row-wise), recorded in the meta's ``row_dtype``; optimizer state and counters stay as they are."""
        if self.meta.row_dtype:
            raise StoreError(f"shard {self.meta.shard}: already in serving dtype {self.meta.row_dtype}")
        rows, qparams = row_codec(dtype).encode(self.rows)
        return replace(self, meta=replace(self.meta, row_dtype=dtype), rows=rows, qparams=qparams)

    def decoded(self, dtype: str = "float32") -> ShardData:
        """Rows of ``dtype`` (a training store's) from a dump in any serving dtype: by its codec's
        ``decode``, the decoding serving uses, so both read the same values (a plain float type
        is cast straight to ``dtype``)."""
        if not self.meta.row_dtype:
            return self
        codec = row_codec(self.meta.row_dtype)
        rows = self.rows if codec.plain else codec.decode(self.rows, self.qparams, None)
        meta = replace(self.meta, row_dtype="")
        return replace(self, meta=meta, rows=rows.astype(dtype, copy=False), qparams=None)

    def select(self, mask: NDArray[np.bool_]) -> ShardData:
        """The rows where ``mask`` is true (deleted signs are kept as they are)."""
        return ShardData(
            self.meta,
            self.signs[mask],
            self.rows[mask],
            {k: v[mask] for k, v in self.state.items()},
            self.stamp[mask],
            self.count[mask],
            self.deleted,
            None if self.qparams is None else self.qparams[mask],
        )


def shard_dir_name(shard: int, num_shards: int) -> str:
    return f"shard-{shard}-of-{num_shards}"


def write_shard(parent: PathLike, data: ShardData) -> Path:
    """Write ``data`` as ``parent/shard-<i>-of-<n>/`` (temporary name, fsync, rename); an
    existing dump of the same name is replaced. Returns the final path."""
    meta = data.meta
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    final = parent / shard_dir_name(meta.shard, meta.num_shards)
    tmp = parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        arrays: dict[str, NDArray[Any]] = {
            "signs.npy": data.signs,
            "rows.npy": data.rows,
            "stamp.npy": data.stamp,
            "count.npy": data.count,
        }
        arrays.update({f"state.{k}.npy": v for k, v in data.state.items()})
        if data.qparams is not None:
            arrays["qparams.npy"] = data.qparams
        order = directory = None
        bits = None
        if meta.kind == "delta":
            arrays["deleted.npy"] = data.deleted
        else:
            order, directory, bits = bucket_layout(data.signs)
        files = {name: write_file(tmp / name, npy_writer(arr, order)) for name, arr in arrays.items()}
        if directory is not None:
            files["buckets.npy"] = write_file(tmp / "buckets.npy", npy_writer(directory))
        meta = replace(meta, format=FORMAT, rows=len(data.signs), deleted=len(data.deleted), bucket_bits=bits)
        body = meta.to_json()
        files[META] = write_file(tmp / META, lambda f: f.write(body))
        manifest = json.dumps({"files": files}, indent=1, sort_keys=True).encode()
        write_file(tmp / MANIFEST, lambda f: f.write(manifest))
        mark_done(tmp)
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


def read_listing(path: Path) -> tuple[dict[str, FileEntry], ShardMeta]:
    """(manifest files, meta) of a complete shard directory, meta checked against its checksum."""
    if not (path / SUCCESS).is_file():
        raise StoreError(f"{path}: no {SUCCESS} marker: the dump is incomplete or still being written")
    try:
        files: dict[str, FileEntry] = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        raise StoreError(f"{path}: unreadable {MANIFEST}: {e}") from e
    if META not in files:
        raise StoreError(f"{path}: {MANIFEST} does not list {META}")
    body = (path / META).read_bytes()
    if not checksum_ok(body, files[META]):
        raise StoreError(f"{path / META}: checksum mismatch")
    return files, ShardMeta.from_json(body, str(path / META))


def read_shard(path: PathLike) -> ShardData:
    """Read and verify one shard directory (full or delta)."""
    path = Path(path)
    files, meta = read_listing(path)
    arrays: dict[str, NDArray[Any]] = {"deleted.npy": np.empty(0, np.uint64)}
    for name, info in files.items():
        if name.endswith(".npy"):
            if not (path / name).is_file():
                raise StoreError(f"{path}: {name} listed in {MANIFEST} is missing")
            arrays[name] = read_npy(path / name, info)
    _validate(path, meta, arrays)
    return ShardData(
        meta=meta,
        signs=arrays["signs.npy"],
        rows=arrays["rows.npy"],
        state={n: arrays[f"state.{n}.npy"] for n in meta.state},
        stamp=arrays["stamp.npy"],
        count=arrays["count.npy"],
        deleted=arrays["deleted.npy"],
        qparams=arrays.get("qparams.npy"),
    )


def _validate(path: Path, meta: ShardMeta, arrays: dict[str, NDArray[Any]]) -> None:
    """Every array meta.json implies is there, with the shape and dtype it says."""
    n, dim, codec = meta.rows, meta.dim, row_codec(meta.dtype)
    checks: list[tuple[str, tuple[int, ...], np.dtype[Any]]] = [
        ("signs", (n,), np.dtype(np.uint64)),
        ("rows", (n, dim), codec.storage),
        ("stamp", (n,), np.dtype(np.uint32)),
        ("count", (n,), np.dtype(np.uint32)),
        ("deleted", (meta.deleted,), np.dtype(np.uint64)),
    ]
    checks += [(f"state.{k}", (n, dim), np.dtype(np.float32)) for k in meta.state]
    if codec.qparams:
        checks.append(("qparams", (n, 2), np.dtype(np.float16)))
    for name, shape, dtype in checks:
        arr = arrays.get(f"{name}.npy")
        if arr is None:
            raise StoreError(f"{path}: {name}.npy is missing")
        if arr.shape != shape or arr.dtype != dtype:
            raise StoreError(f"{path}: {name}.npy is {arr.dtype}{arr.shape}, meta.json says {dtype}{shape}")


def check_compatible(meta: ShardMeta, dim: int, dtype: str, schema_hash: str, where: str = "") -> None:
    """Refuse a dump whose dim, row dtype or feature-schema hash differs from the store's."""
    where = where or f"shard {meta.shard} of {meta.num_shards}"
    if meta.dim != dim:
        raise StoreError(f"{where}: dim {meta.dim} does not match the store's dim {dim}")
    if meta.dtype != dtype and not meta.row_dtype:  # a serving dtype's dump is decoded on reading
        raise StoreError(f"{where}: dtype {meta.dtype} does not match the store's dtype {dtype}")
    if schema_hash and meta.schema_hash != schema_hash:
        raise StoreError(
            f"{where}: schema hash {meta.schema_hash!r} does not match the store's {schema_hash!r} "
            "(the dump was trained with another feature schema)"
        )


def shard_dirs(paths: PathLike | Sequence[PathLike]) -> list[Path]:
    """The shard directories named by ``paths``: a shard directory itself, a directory holding
    ``shard-<i>-of-<n>/`` directories (all n must be there), or a list of shard directories."""
    if not isinstance(paths, (str, os.PathLike)):
        return [Path(p) for p in paths]
    root = Path(paths)
    if (root / META).exists() or _SHARD_RE.match(root.name):  # not _SUCCESS: a delta dir has its own
        return [root]
    if not root.is_dir():
        raise StoreError(f"{root}: no such dump directory")
    found = [m for p in root.iterdir() if (m := _SHARD_RE.match(p.name))]
    if not found:
        raise StoreError(f"{root}: no shard-<i>-of-<n> directories in it")
    counts = {int(m.group(2)) for m in found}
    if len(counts) != 1:
        raise StoreError(f"{root}: dumps of different shard counts {sorted(counts)} side by side")
    n = counts.pop()
    missing = sorted(set(range(n)) - {int(m.group(1)) for m in found})
    if missing:
        raise StoreError(f"{root}: shards {missing} of {n} are missing")
    return [root / shard_dir_name(i, n) for i in range(n)]


def read_meta(shard_dir: PathLike) -> ShardMeta:
    """A shard directory's meta.json, unverified (to decide how to read it; readers verify)."""
    try:
        body = (Path(shard_dir) / META).read_bytes()
    except OSError as e:
        raise StoreError(f"{shard_dir}: unreadable {META}: {e}") from e
    return ShardMeta.from_json(body, str(Path(shard_dir) / META))


def read_for_shard(
    paths: PathLike | Sequence[PathLike],
    shard: int,
    num_shards: int,
    check: Callable[[ShardMeta, str], object] | None = None,
) -> ShardData:
    """The part of a dump (full or delta, any shard count) that shard ``shard`` of
    ``num_shards`` owns, by the routing hash. ``check(meta, where)`` vets each shard's metadata
    before its arrays are read."""
    dirs = shard_dirs(paths)
    metas = [read_meta(d) for d in dirs]
    if check is not None:
        for d, m in zip(dirs, metas, strict=True):
            check(m, str(d))
    same = [d for d, m in zip(dirs, metas, strict=True) if (m.shard, m.num_shards) == (shard, num_shards)]
    if same and all(m.num_shards == num_shards for m in metas) and len(dirs) == num_shards:
        return read_shard(same[0])  # same layout: read only our own shard
    parts = []
    for d in dirs:
        data = read_shard(d)
        if data.meta.num_shards == num_shards and data.meta.shard == shard:
            parts.append(data)
        else:
            parts.append(data.select(shard_of(data.signs, num_shards) == shard))
    return _concat(parts)


def _concat(parts: list[ShardData]) -> ShardData:
    if len(parts) == 1:
        return parts[0]
    for key in ("kind", "dim", "dtype", "optimizer", "delta_seq", "version"):
        values = {str(getattr(p.meta, key)) for p in parts}
        if len(values) > 1:
            raise StoreError(f"shard dumps disagree on {key}: {sorted(values)}")
    return ShardData(
        meta=replace(parts[0].meta, step=max(p.meta.step for p in parts)),
        signs=np.concatenate([p.signs for p in parts]),
        rows=np.concatenate([p.rows for p in parts]),
        state={k: np.concatenate([p.state[k] for p in parts]) for k in parts[0].state},
        stamp=np.concatenate([p.stamp for p in parts]),
        count=np.concatenate([p.count for p in parts]),
        deleted=unique_signs(np.concatenate([p.deleted for p in parts])),
        qparams=None if parts[0].qparams is None else np.concatenate([p.qparams for p in parts]),
    )


def encode_dump(path: PathLike, dtype: str) -> None:
    """Rewrite the float32 dump (full or delta) at ``path`` in serving dtype ``dtype`` (nothing to
    do for float32): what the export does to a version's shards and deltas before marking them done."""
    if dtype == "float32":
        return
    for d in shard_dirs(path):
        write_shard(d.parent, read_shard(d).encoded(dtype))


def encode_delta(path: PathLike, version_dir: PathLike) -> None:
    """``encode_dump`` of the delta at ``path`` in the serving dtype of the version at
    ``version_dir`` (a delta is served like its version's shards)."""
    meta = read_meta(shard_dirs(Path(version_dir) / "embeddings")[0])
    encode_dump(path, meta.row_dtype or "float32")
