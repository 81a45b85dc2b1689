"""One file of a shard dump: written through a checksumming, block-aligned writer, read back and
checked against its manifest entry (``model_store.shards`` lays the files out; a serving PS maps
them and checks them with ``checksum_ok``).

A manifest entry is ``{"xxh3_128": <hex>, "bytes": <size>}`` (dumps written before XXH3:
``{"sha256": <hex>, ...}``, which still verifies). Arrays are plain ``.npy`` files.
"""

from __future__ import annotations

import hashlib
import io
import mmap
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from model_store.errors import StoreError

XXH3 = "xxh3_128"  # a shard file's fast checksum in its MANIFEST.json (older dumps: sha256 only)
CHUNK_ROWS = 1 << 18  # rows gathered per write of a bucket-ordered array (16 MB of dim-16 rows)

Bytes = bytes | bytearray | memoryview
FileEntry = dict[str, str | int]  # a file's manifest entry: its checksum and size
Writer = Callable[["HashingWriter"], object]  # puts one file's bytes through a HashingWriter


class _Sink(Protocol):
    """The file a HashingWriter writes to (a raw file: a write may take fewer bytes than given)."""

    def write(self, b: memoryview, /) -> int: ...


class _Hash(Protocol):
    def update(self, data: Bytes | mmap.mmap, /) -> None: ...
    def hexdigest(self) -> str: ...


class HashingWriter:
    """A write-only file wrapper that hashes what passes through (np.save writes through it)
    with XXH3-128, the checksum a reader checks (``checksum_ok``): 15 GB/s on one core against
    sha256's 1.5, so a 50M-row version's shard is checked in ~0.1 s, not 1.2 s of a core taken
    from lookups. Dumps written before it carry sha256, which still verifies.

    Bytes reach the file in whole ``BLOCK``s at ``BLOCK``-aligned offsets (the rest at
    ``close``): the page cache then holds a fresh dump in 2 MB folios, which a serving PS maps
    with 2 MB page-table entries. Gathered 2 MB pieces after the 128-byte npy header left
    ``signs.npy`` entirely in 4 KB pages (16 MB pieces: 87%)."""

    BLOCK = 16 << 20

    def __init__(self, f: _Sink) -> None:
        import xxhash

        self.f = f
        self.xxh = xxhash.xxh3_128()
        self.size = 0
        self.pending = bytearray()

    def write(self, b: Bytes) -> int:
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

    def _write(self, b: Bytes) -> None:
        with memoryview(b) as view:
            while view:
                view = view[self.f.write(view) :]


def write_file(path: Path, writer: Writer) -> FileEntry:
    """Write one file through a HashingWriter, fsync it, and return its manifest entry."""
    with open(path, "wb", buffering=0) as f:
        hw = HashingWriter(f)
        writer(hw)
        hw.close()
        os.fsync(f.fileno())
    return {XXH3: hw.xxh.hexdigest(), "bytes": hw.size}


def npy_writer(arr: NDArray[Any], order: NDArray[np.intp] | None = None) -> Writer:
    """Writes ``arr`` (or ``arr[order]``, gathered a chunk at a time: no full permuted copy)."""
    if order is None:
        return lambda f: np.lib.format.write_array(f, np.ascontiguousarray(arr), allow_pickle=False)

    def write(f: HashingWriter) -> None:
        np.lib.format.write_array_header_1_0(f, np.lib.format.header_data_from_array_1_0(arr))
        for i in range(0, len(order), CHUNK_ROWS):
            f.write(np.ascontiguousarray(arr.take(order[i : i + CHUNK_ROWS], axis=0)).data.cast("B"))

    return write


_NPY_V1 = re.compile(
    rb"\{'descr': '([<>|=][a-z]\d{1,2})', 'fortran_order': False, 'shape': \(((?:\d+, ?)*\d*)\), \} *\n"
)
"""The header numpy writes for a plain C-order array (format 1.0), parsed without numpy's
``ast.literal_eval`` (a sixth of reading a delta): anything else takes numpy's own parser."""


def npy_header(path: Path, head: bytes) -> tuple[tuple[int, ...], np.dtype[Any], int]:
    """(shape, dtype, data offset) of a .npy file from its first bytes; StoreError if it is not a
    plain C-order array."""
    if head[:8] == b"\x93NUMPY\x01\x00" and len(head) >= 10:
        size = int.from_bytes(head[8:10], "little")
        m = _NPY_V1.fullmatch(head[10 : 10 + size])
        if m is not None:
            shape = tuple(int(x) for x in m[2].split(b",") if x.strip())
            return shape, np.dtype(m[1].decode()), 10 + size
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


def checksum_ok(
    buf: Bytes | mmap.mmap, expect: Mapping[str, object], duty: float = 1.0, chunk: int = 4 << 20
) -> bool:
    """Whether a shard file's bytes match its manifest entry: XXH3-128 where the dump has it,
    else sha256. ``duty`` 1 hashes in one call (no GIL held meanwhile); below 1 the pass goes in
    ``chunk``-byte pieces paced to ``duty`` (``VERIFY_DUTY``: a serving PS's pass)."""
    h: _Hash
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


def read_npy(path: Path, expect: Mapping[str, object]) -> NDArray[Any]:
    """One read, checksum over the bytes, then an array view of them (no second copy)."""
    buf = bytearray(path.read_bytes())
    if len(buf) != expect.get("bytes", len(buf)) or not checksum_ok(buf, expect):
        raise StoreError(f"{path}: checksum mismatch (file corrupt or modified after the dump)")
    shape, dtype, offset = npy_header(path, bytes(buf[: 1 << 16]))
    return np.frombuffer(buf, dtype=dtype, count=int(np.prod(shape)), offset=offset).reshape(shape)
