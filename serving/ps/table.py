"""Immutable bucket-ordered tables: a served version's rows, mapped read-only from its files.

A full shard dump (model_store.shards) stores its signs in bucket order with a directory of
bucket offsets, so the dump *is* a hash index: the signs of bucket ``b`` (the top ``bits`` bits of
``table_hash(sign)``) are ``keys[buckets[b]:buckets[b + 1]]``, 4 to 8 of them on average, and
their rows are at the same positions. ``Table.open`` maps ``signs.npy``, ``rows.npy`` and
``buckets.npy`` read-only (``mmap``), after checking each file's sha256 against the dump's
manifest *through the mapping*: verifying is also what brings the pages in, so the first lookups
after a flip do not fault. Processes mapping the same version share its pages in the page cache.
A table costs 8 bytes of key + the row + 0.5-1 byte of directory per row, and nothing to build.

``Table.build`` makes the same structure in memory (deltas' overlays, re-sharded or old dumps).
The lookup kernel works 32 signs at a time in three passes (directory, keys, rows) so the
cache misses of different signs overlap, like ``index.gather_rows``.
"""

from __future__ import annotations

import hashlib
import mmap
import time
from dataclasses import dataclass
from pathlib import Path

import numba
import numpy as np
from numba import types
from numba.extending import overload

from model_store import shards
from model_store.shards import StoreError

_SALT = shards.TABLE_SALT
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_VERIFY_CHUNK = 64 << 20


@numba.njit(inline="always")
def _hash(sign):
    """``model_store.shards.table_hash`` for one sign (the test checks they agree)."""
    z = sign ^ _SALT
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


_POW2 = 2.0 ** (np.arange(32, dtype=np.float64) - 25)  # (1024 + mantissa) * _POW2[exponent]


@numba.njit(inline="always")
def _half(h):
    """IEEE half (its uint16 bits) -> float (numba has no float16)."""
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        v = m * 5.960464477539063e-08  # subnormal: m * 2**-24
    elif e == 31:
        v = np.inf if m == 0 else np.nan
    else:
        v = (1024 + m) * _POW2[e]
    return -v if h & 0x8000 else v


def _to_float(x):  # rows of float32 pass through; float16 rows arrive as their uint16 bits
    raise NotImplementedError


@overload(_to_float, inline="always")
def _to_float_impl(x):
    if isinstance(x, types.Float):
        return lambda x: x
    if x == types.uint16:
        return lambda x: _half(x)
    return None


@numba.njit(cache=True, nogil=True)
def gather(buckets, keys, rows, dead, signs, shift, out, slots, zero_missing):
    """slots[i] = position of signs[i] in ``keys`` or -1; out[i] = its row as float32 (zeros if
    dead). A missing sign's row is zeroed when ``zero_missing`` and left alone otherwise (an
    overlay pass over rows the base already wrote)."""
    n = len(signs)
    dim = rows.shape[1]
    has_dead = len(dead) > 0
    B = 32
    lo = np.empty(B, dtype=np.int64)
    hi = np.empty(B, dtype=np.int64)
    sh = np.uint64(shift)
    for b0 in range(0, n, B):
        m = min(B, n - b0)
        for k in range(m):  # pass 1: the bucket's bounds
            b = np.int64(_hash(signs[b0 + k]) >> sh)
            lo[k] = buckets[b]
            hi[k] = buckets[b + 1]
        for k in range(m):  # pass 2: the key among the bucket's 4-8
            s = signs[b0 + k]
            slot = -1
            for j in range(lo[k], hi[k]):
                if keys[j] == s:
                    slot = j
                    break
            slots[b0 + k] = slot
        for k in range(m):  # pass 3: the row
            i = b0 + k
            slot = slots[i]
            if slot >= 0 and not (has_dead and dead[slot]):
                for j in range(dim):
                    out[i, j] = _to_float(rows[slot, j])
            elif slot >= 0 or zero_missing:
                for j in range(dim):
                    out[i, j] = 0.0


@dataclass(frozen=True)
class Table:
    """Signs in bucket order, their rows, the bucket directory; optionally tombstones."""

    keys: np.ndarray
    rows: np.ndarray
    buckets: np.ndarray
    bits: int
    dead: np.ndarray  # bool per key (overlays: deleted signs); empty for a version's table
    mapped: bool = False
    maps: tuple = ()  # the mmap objects behind a mapped table's arrays

    def release(self, pause_s: float = 0.05) -> None:
        """Drop a retired table's page tables in 64 MB steps (each step holds the process's mmap
        lock shortly, for reading) so that the final munmap, whichever thread drops the last
        reference, has almost nothing to tear down: unmapping 1.8 GB at once stalled lookups for
        tens of ms. Waits ``pause_s`` first, for lookups still reading the old snapshot; a late
        one faults the pages back in from the page cache and reads the same bytes."""
        if not self.maps:
            return
        time.sleep(pause_s)
        step = 64 << 20
        for mm in self.maps:
            for i in range(0, len(mm), step):
                try:
                    mm.madvise(mmap.MADV_DONTNEED, i, min(step, len(mm) - i))
                except (OSError, ValueError):
                    break

    @classmethod
    def empty(cls, dim: int, dtype="float32") -> Table:
        return cls.build(np.empty(0, np.uint64), np.empty((0, dim), dtype))

    @classmethod
    def build(cls, signs: np.ndarray, rows: np.ndarray, dead: np.ndarray | None = None) -> Table:
        """The table of distinct ``signs`` in memory (sorts them into bucket order)."""
        order, directory, bits = shards.bucket_layout(signs)
        d = np.empty(0, np.bool_) if dead is None else np.ascontiguousarray(dead[order])
        return cls(np.ascontiguousarray(signs[order]), np.ascontiguousarray(rows[order]), directory, bits, d)

    @classmethod
    def open(cls, shard_dir: str | Path) -> tuple[Table, dict]:
        """Map a full dump's bucket-ordered files read-only, each verified against the manifest
        first. Raises StoreError if the dump is incomplete, corrupt or not bucket-ordered."""
        path = Path(shard_dir)
        files, meta = shards.read_listing(path)
        if meta.get("kind") != "full" or "bucket_bits" not in meta:
            raise StoreError(f"{path}: not a bucket-ordered full dump")
        n, dim, bits = int(meta["rows"]), int(meta["dim"]), int(meta["bucket_bits"])
        expect = {
            "signs.npy": ((n,), np.dtype(np.uint64)),
            "rows.npy": ((n, dim), np.dtype(meta["dtype"])),
            "buckets.npy": (((1 << bits) + 1,), np.dtype(np.uint32)),
        }
        arrays, maps = {}, []
        for name, (shape, dtype) in expect.items():
            if name not in files:
                raise StoreError(f"{path}: {shards.MANIFEST} does not list {name}")
            arrays[name], mm = _map_npy(path / name, files[name], shape, dtype)
            maps.append(mm)
        buckets = arrays["buckets.npy"]
        if buckets[0] != 0 or buckets[-1] != n or np.any(np.diff(buckets.astype(np.int64)) < 0):
            raise StoreError(f"{path}: buckets.npy is not a directory of {n} rows")
        table = cls(
            arrays["signs.npy"], arrays["rows.npy"], buckets, bits, np.empty(0, np.bool_), True, tuple(maps)
        )
        return table, meta

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def dim(self) -> int:
        return self.rows.shape[1]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.rows.nbytes + self.buckets.nbytes + self.dead.nbytes

    def gather(self, signs: np.ndarray, out: np.ndarray, zero_missing: bool = True) -> np.ndarray:
        """Write the rows of ``signs`` into ``out`` (float32); returns each sign's slot or -1."""
        slots = np.empty(len(signs), dtype=np.int64)
        if len(signs):
            rows = self.rows.view(np.uint16) if self.rows.dtype == np.float16 else self.rows
            gather(self.buckets, self.keys, rows, self.dead, signs, 64 - self.bits, out, slots, zero_missing)
        return slots

    def find(self, signs: np.ndarray) -> np.ndarray:
        """Each sign's slot or -1 (tombstoned signs included)."""
        return self.gather(signs, np.empty((len(signs), self.dim), np.float32))

    def astype(self, dtype) -> Table:
        """The same table with rows of ``dtype`` (a copy in memory; keys and directory shared)."""
        if self.rows.dtype == np.dtype(dtype):
            return self
        return Table(
            self.keys, self.rows.astype(dtype), self.buckets, self.bits, self.dead, self.mapped, self.maps
        )


def _map_npy(path: Path, expect: dict, shape: tuple, dtype: np.dtype) -> tuple[np.ndarray, mmap.mmap]:
    """Map a .npy file read-only after checking its sha256 through the mapping (which also
    brings its pages into memory before the table serves)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size != expect.get("bytes", size):
                raise StoreError(f"{path}: {size} bytes, the manifest says {expect.get('bytes')}")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    except OSError as e:
        raise StoreError(f"{path}: {e}") from e
    if mm is None:
        raise StoreError(f"{path}: empty file")
    sha = hashlib.sha256()
    view = memoryview(mm)
    try:
        for i in range(0, size, _VERIFY_CHUNK):
            sha.update(view[i : i + _VERIFY_CHUNK])  # releases the GIL: lookups go on
    finally:
        view.release()
    if sha.hexdigest() != expect["sha256"]:
        raise StoreError(f"{path}: checksum mismatch (file corrupt or modified after the dump)")
    got_shape, got_dtype, offset = shards.npy_header(path, mm[: min(size, 1 << 16)])
    if got_shape != shape or got_dtype != dtype:
        raise StoreError(f"{path}: is {got_dtype}{got_shape}, meta.json says {dtype}{shape}")
    count = int(np.prod(shape))
    return np.frombuffer(mm, dtype=dtype, count=count, offset=offset).reshape(shape), mm
