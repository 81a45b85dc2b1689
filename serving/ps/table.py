"""Immutable bucket-ordered tables: a served version's rows, mapped read-only from its files.

A full shard dump (model_store.shards) stores its signs in bucket order with a directory of
bucket offsets, so the dump *is* a hash index: the signs of bucket ``b`` (the top ``bits`` bits of
``table_hash(sign)``) are ``keys[buckets[b]:buckets[b + 1]]``, 4 to 8 of them on average, and
their rows are at the same positions. ``BucketTable.open`` maps ``signs.npy``, ``rows.npy`` and
``buckets.npy`` read-only (``mmap``), after checking each file's checksum (XXH3-128; sha256 in
dumps written before it) against the dump's manifest *through the mapping*: verifying is also
what brings the pages in, so the first lookups after a flip do not fault. Checksum passes beside
a served version are paced (``shards.VERIFY_DUTY``: hash a piece, sleep as long) and all take
turns host-wide (``checksum_slot``), so the shards of a host switching together take neither the
cores nor the memory bandwidth their lookups need. Processes mapping the same version share its
pages in the page cache.
A table costs 8 bytes of key + the row + 0.5-1 byte of directory per row, and nothing to build.
A table knows its serving dtype by name (``dtype``: the dump's, never guessed from its arrays) and
decodes by that row codec (``model_store.quant.CODECS``), chosen once when the table is made. An
int8 version's table also maps ``qparams.npy`` (each row's fp16 scale and bias: dim + 4 bytes a
row in all) and ``gather`` dequantizes the rows it takes in the same vectorised pass
(``model_store.quant.dequantize``).

``BucketTable.build`` makes the same structure in memory (deltas' overlays, re-sharded or old dumps).
A lookup is numpy over the whole request (the directory, every candidate key of every bucket, the
rows), so the random reads of different signs overlap in the memory system. Serving needs no
compiled kernel: a serving PS process does not load numba (~120 MB of resident memory per
process, more than a byte per row of a 50M-row version over 2 shards). At 25M rows per shard a
4,000-sign gather takes ~0.8 ms against ~0.67 ms for the numba kernel this replaced.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from model_store import shards
from model_store.errors import StoreError
from model_store.meta import ShardMeta
from model_store.quant import QPARAMS, Decode, StoredRows, row_codec


@dataclass(frozen=True)
class BucketTable:
    """Signs in bucket order, their rows, the bucket directory; optionally tombstones."""

    keys: np.ndarray
    rows: np.ndarray
    buckets: np.ndarray
    bits: int
    dead: np.ndarray  # bool per key (overlays: deleted signs); empty for a version's table
    mapped: bool = False
    maps: tuple = ()  # the mmap objects behind a mapped table's arrays
    qparams: np.ndarray | None = None  # int8 tables: each row's fp16 (scale, bias)
    dtype: str = field(kw_only=True)
    """The serving dtype of the rows (a ``model_store.quant.CODECS`` name): float32, float16, int8..."""
    _decode: Decode | None = field(init=False, repr=False, compare=False, default=None)
    """The codec's decoding, None for a plain float type (rows read as they are): set once, here."""

    def __post_init__(self) -> None:
        codec = row_codec(self.dtype)
        if self.rows.dtype != codec.storage or (self.qparams is not None) != codec.qparams:
            raise ValueError(
                f"{self.dtype} rows are {codec.storage} arrays{' with qparams' * codec.qparams}; got "
                f"{self.rows.dtype}{' with qparams' * (self.qparams is not None)}"
            )
        object.__setattr__(self, "_decode", None if codec.plain else codec.decode)

    def release(self, pause_s: float = 0.05) -> None:
        """Drop a retired table's page tables in 64 MB steps so that the final munmap, whichever
        thread drops the last reference, has almost nothing to tear down: unmapping 1.8 GB at once
        stalled lookups for tens of ms. Each step is ``madvise`` called through ctypes, which
        lets go of the GIL (``mmap.madvise`` holds it: the event loop then stalled 10-20 ms per
        release), with a 1 ms pause between steps. Waits ``pause_s`` first, for lookups still
        reading the old snapshot; a late one faults the pages back in from the page cache and
        reads the same bytes."""
        if not self.maps:
            return
        time.sleep(pause_s)
        step = 64 << 20
        for mm in self.maps:
            try:
                base = np.frombuffer(mm, np.uint8).ctypes.data
            except ValueError:  # closed
                continue
            for i in range(0, len(mm), step):
                if _madvise(base + i, min(step, len(mm) - i), mmap.MADV_DONTNEED) != 0:
                    break
                time.sleep(0.001)

    @classmethod
    def empty(cls, dim: int, dtype: str = "float32") -> BucketTable:
        """A table of no rows of serving dtype ``dtype`` (int8: codes and their qparams)."""
        codec = row_codec(dtype)
        qparams = np.empty((0, 2), QPARAMS) if codec.qparams else None
        return cls.build(
            np.empty(0, np.uint64), np.empty((0, dim), codec.storage), qparams=qparams, dtype=dtype
        )

    @classmethod
    def build(
        cls,
        signs: np.ndarray,
        rows: np.ndarray,
        dead: np.ndarray | None = None,
        qparams: np.ndarray | None = None,
        dtype: str = "",
    ) -> BucketTable:
        """The table of distinct ``signs`` in memory (sorts them into bucket order); ``rows`` in
        serving dtype ``dtype`` ('': the rows' own float type), int8's with their ``qparams``."""
        order, directory, bits = shards.bucket_layout(signs)
        d = np.empty(0, np.bool_) if dead is None else np.ascontiguousarray(dead[order])
        qp = None if qparams is None else np.ascontiguousarray(qparams[order])
        rows = np.ascontiguousarray(rows[order])
        return cls(np.ascontiguousarray(signs[order]), rows, directory, bits, d, qparams=qp,
                   dtype=dtype or rows.dtype.name)  # fmt: skip

    def upserted(
        self,
        signs: np.ndarray,
        rows: np.ndarray,
        dead: np.ndarray,
        qparams: np.ndarray | None = None,
        slots: np.ndarray | None = None,
    ) -> BucketTable:
        """A new table: this one with the distinct ``signs`` set to ``rows`` (tombstoned where
        ``dead``); self is unchanged. The new signs are sorted alone and inserted into the bucket
        order: copies of this table plus a sort of the new signs, where ``build`` sorts them all
        (a delta into an overlay of 50,000 rows: ~21 ms a build, on the thread that also serves)."""
        slots = self.find(signs) if slots is None else slots  # ``slots``: the caller's find of ``signs`` here
        fresh = slots < 0
        h_new = shards.table_hash(signs[fresh])
        order = np.argsort(h_new)
        h_new = h_new[order]
        add = np.flatnonzero(fresh)[order]
        h = shards.table_hash(self.keys)
        at = np.searchsorted(h, h_new)
        kept = slots[~fresh]
        moved = kept + np.searchsorted(
            at, kept, side="right"
        )  # where the present signs are after the inserts
        own_dead = self.dead if len(self.dead) == len(self) else np.zeros(len(self), np.bool_)

        def merged(old: np.ndarray, new: np.ndarray) -> np.ndarray:
            out = np.insert(old, at, new[add], axis=0)
            out[moved] = new[~fresh]
            return out

        keys = np.insert(self.keys, at, signs[add])
        bits = shards.bucket_bits(len(keys))
        directory = shards.bucket_directory(np.insert(h, at, h_new), bits)
        q = None if qparams is None or self.qparams is None else merged(self.qparams, qparams)
        return type(self)(keys, merged(self.rows, rows.astype(self.rows.dtype, copy=False)), directory, bits,
                          merged(own_dead, dead), qparams=q, dtype=self.dtype)  # fmt: skip

    @classmethod
    def open(cls, shard_dir: str | Path, duty: float = 1.0) -> tuple[BucketTable, ShardMeta]:
        """Map a full dump's bucket-ordered files read-only, each verified against the manifest
        first, its checksum pass paced to ``duty``. Raises StoreError if the dump is incomplete,
        corrupt or not bucket-ordered."""
        path = Path(shard_dir)
        files, meta = shards.read_listing(path)
        if meta.kind != "full" or meta.bucket_bits is None:
            raise StoreError(f"{path}: not a bucket-ordered full dump")
        n, dim, bits, codec = meta.rows, meta.dim, meta.bucket_bits, row_codec(meta.dtype)
        expect: dict[str, tuple[tuple[int, ...], np.dtype]] = {
            "signs.npy": ((n,), np.dtype(np.uint64)),
            "rows.npy": ((n, dim), codec.storage),
            "buckets.npy": (((1 << bits) + 1,), np.dtype(np.uint32)),
        }
        if codec.qparams:
            expect["qparams.npy"] = ((n, 2), np.dtype(np.float16))
        arrays, maps = {}, []
        for name, (shape, dtype) in expect.items():
            if name not in files:
                raise StoreError(f"{path}: {shards.MANIFEST} does not list {name}")
            arrays[name], mm = _map_npy(path / name, files[name], shape, dtype, duty)
            maps.append(mm)
        buckets = arrays["buckets.npy"]
        # monotone: one uint32 comparison pass (a diff in int64 made 64 MB of temporaries, ~50 ms)
        if buckets[0] != 0 or buckets[-1] != n or bool((buckets[1:] < buckets[:-1]).any()):
            raise StoreError(f"{path}: buckets.npy is not a directory of {n} rows")
        table = cls(
            arrays["signs.npy"], arrays["rows.npy"], buckets, bits, np.empty(0, np.bool_), True, tuple(maps),
            arrays.get("qparams.npy"), dtype=meta.dtype,
        )  # fmt: skip
        return table, meta

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def dim(self) -> int:
        return self.rows.shape[1]

    @property
    def nbytes(self) -> int:
        q = 0 if self.qparams is None else self.qparams.nbytes
        return self.keys.nbytes + self.rows.nbytes + self.buckets.nbytes + self.dead.nbytes + q

    def _take(self, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """float32 rows at ``slots`` (int8: dequantized in the same pass; a plain float type as it
        is, or converted into ``out``)."""
        if self._decode is not None:
            return self._decode(self.rows[slots], None if self.qparams is None else self.qparams[slots], out)
        if out is None:
            return self.rows[slots]
        if self.rows.dtype == out.dtype:
            return np.take(self.rows, slots, axis=0, out=out)
        out[:] = self.rows[slots]
        return out

    def _live(self, slots: np.ndarray) -> np.ndarray:
        """Which slots hold a row (found and not tombstoned)."""
        hit = slots >= 0
        if not len(self.dead):
            return hit
        live = hit.copy()
        live[hit] = ~self.dead[slots[hit]]
        return live

    def gather_stored(self, signs: np.ndarray, out: StoredRows, zero_missing: bool = True) -> np.ndarray:
        """``gather`` without decoding: the rows of ``signs`` as this table stores them (values and,
        int8, qparams; zeros decode to a zero row) into ``out``, arrays of this table's types."""
        slots = self.find(signs)
        live = self._live(slots)
        hidden = ~live if zero_missing else (slots >= 0) & ~live  # a tombstone hides the base's row
        for src, dst in ((self.rows, out.values), (self.qparams, out.qparams)):
            if src is None or dst is None:
                continue
            if live.all():
                np.take(src, slots, axis=0, out=dst)
                continue
            dst[hidden] = 0
            dst[live] = src[slots[live]]
        return slots

    def gather(self, signs: np.ndarray, out: np.ndarray, zero_missing: bool = True) -> np.ndarray:
        """Write the rows of ``signs`` into ``out`` (float32); returns each sign's slot or -1."""
        slots = self.find(signs)
        hit = slots >= 0
        live = self._live(slots)
        if live.all():
            self._take(slots, out)
            return slots
        if zero_missing:
            out[~live] = 0.0
        else:
            out[hit & ~live] = 0.0  # a tombstone hides the base's row
        out[live] = self._take(slots[live])
        return slots

    def find(self, signs: np.ndarray) -> np.ndarray:
        """Each sign's slot or -1 (tombstoned signs included), vectorised: every key of every
        sign's bucket (4-8 on average, adjacent in ``keys``) is compared in one pass. In a process
        that has numba loaded already (a co-located scorer, a training PS) the compiled twin
        ``serving.ps.index.bucket_find`` does it, 5x faster on a request's signs; a serving PS
        shard stays numpy-only (no LLVM in its memory).

        The kernel always gets read-only views: numba compiles one specialisation per argument
        type, and writability is part of the type. A mapped version's arrays are read-only, a
        delta's overlay (built in memory) and most request signs are not, so the first lookup
        after the first delta compiled a second specialisation on the request's thread (130 ms,
        or 2-3 ms from numba's disk cache; requests queued behind it: p99 126 ms against 14.8 ms
        steady in bench-swap). One type, compiled by the scorer's warm-up, serves them all."""
        if "numba" in sys.modules and len(signs) and len(self.keys):
            from serving.ps.index import bucket_find

            signs = np.ascontiguousarray(signs, np.uint64)  # a strided view would be another type too
            return bucket_find(_read_only(self.keys), _read_only(self.buckets), _read_only(signs), self.bits)
        return self._find_numpy(signs)

    def _find_numpy(self, signs: np.ndarray) -> np.ndarray:
        n = len(signs)
        slots = np.full(n, -1, dtype=np.int64)
        if n == 0 or len(self.keys) == 0:
            return slots
        b = (shards.table_hash(signs) >> np.uint64(64 - self.bits)).astype(np.intp)
        lo = self.buckets[b].astype(np.intp)
        lens = self.buckets[b + 1].astype(np.intp) - lo
        ends = np.cumsum(lens)
        owner = np.repeat(np.arange(n), lens)  # candidate k belongs to sign owner[k]
        pos = np.arange(int(ends[-1])) + np.repeat(lo - (ends - lens), lens)
        match = np.flatnonzero(self.keys[pos] == signs[owner])
        slots[owner[match]] = pos[match]
        return slots

    def astype(self, dtype) -> BucketTable:
        """The same table with rows of plain float type ``dtype`` (a copy in memory; keys and
        directory shared); a table of codes (int8) is returned as it is."""
        if self.rows.dtype == np.dtype(dtype) or self._decode is not None:  # codes stay codes
            return self
        return BucketTable(
            self.keys, self.rows.astype(dtype), self.buckets, self.bits, self.dead, self.mapped, self.maps,
            dtype=np.dtype(dtype).name,
        )  # fmt: skip


def _read_only(a: np.ndarray) -> np.ndarray:
    """``a`` as a read-only view (``a`` itself when it is read-only already)."""
    if not a.flags.writeable:
        return a
    v = a.view()
    v.flags.writeable = False
    return v


def _madvise(addr: int, length: int, advice: int) -> int:
    """libc ``madvise`` without the GIL (ctypes releases it around foreign calls); 0 on success."""
    return _libc_madvise()(addr, length, advice)


@functools.cache
def _libc_madvise():
    import ctypes

    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def _map_npy(
    path: Path, expect: dict, shape: tuple, dtype: np.dtype, duty: float = 1.0
) -> tuple[np.ndarray, mmap.mmap]:
    """Map a .npy file read-only after its checksum matches the manifest: XXH3-128 where the dump
    has it, else sha256 (dumps written before it).

    The checksum runs over the mapping, so it is what brings the pages in and the first lookups
    after the flip do not fault. Beside a served version it goes in 4 MB pieces paced to ``duty``
    (``shards.VERIFY_DUTY``; a full-speed pass, one GIL-free call, took the memory bandwidth of
    the lookups on the other core: their p99 doubled while it ran), each piece without the GIL;
    always in a host-wide checksum slot (``checksum_slot``)."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size != expect.get("bytes", size):
                raise StoreError(f"{path}: {size} bytes, the manifest says {expect.get('bytes')}")
            if not size:
                raise StoreError(f"{path}: empty file")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise StoreError(f"{path}: {e}") from e
    with checksum_slot(), memoryview(mm) as view:
        ok = shards.checksum_ok(view, expect, duty)
    if not ok:
        mm.close()
        raise StoreError(f"{path}: checksum mismatch (file corrupt or modified after the dump)")
    got_shape, got_dtype, offset = shards.npy_header(path, mm[: min(size, 1 << 16)])
    if got_shape != shape or got_dtype != dtype:
        mm.close()
        raise StoreError(f"{path}: is {got_dtype}{got_shape}, meta.json says {dtype}{shape}")
    count = int(np.prod(shape))
    return np.frombuffer(mm, dtype=dtype, count=count, offset=offset).reshape(shape), mm


CHECKSUM_SLOTS = max(1, (os.cpu_count() or 1) // 4)
"""Checksum passes that may run at once on a host, over every serving PS process on it."""


@contextlib.contextmanager
def checksum_slot(slots: int | None = None, lock_dir: str | None = None):
    """Hold one of the host's ``CHECKSUM_SLOTS`` checksum slots (``serving.priority.host_slot``).

    Shards of one host switch versions together; each verifying its 1.8 GB at once kept both
    cores of the 2-core dev box busy and doubled the lookups' p99 (7.7 vs 4.0 ms; lowering the
    threads' priority did not help, a lookup still waited behind a busy core). One pass at a
    time leaves cores to the lookups; pacing each pass (``shards.VERIFY_DUTY``) leaves them the
    memory bandwidth too: p99 during a 50M-row switch 1.1-1.45x steady. Passes beyond the slots
    wait their turn: a paced pass over a 25M-row shard takes ~1.2 s."""
    from serving.priority import host_slot

    with host_slot("checksum", CHECKSUM_SLOTS if slots is None else slots, lock_dir):
        yield
