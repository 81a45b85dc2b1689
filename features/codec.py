"""The compact-batch wire format: ``encode(batch) -> bytes``, ``decode(bytes) -> CompactBatch``.

Little-endian, every section 8-byte aligned::

    offset  size  field
    0       4     magic b"RSCB"
    4       2     version (1)
    6       2     flags: bit0 labels present, bit1 request context present
    8       8     checksum: XXH64 (seed 0) of every byte from offset 16 to the end
    16      8     schema hash (``Schema.hash64``; 0 = unspecified)
    24      4     num_rows
    28      4     num_slots (S)
    32      4     per-row dense columns (F_row)
    36      4     context dense columns (F_ctx)
    40      1     index width in bytes (1, 2 or 4)
    41      7     reserved, zero
    48            sign_counts u32[S], value_counts u32[S], flags u8[S]      (padded to 8)
                  signs u64[sum sign_counts]
                  values uint{8,16,32}[sum value_counts]                      (padded to 8)
                  offsets u32[sum over multi slots of rows_s + 1]             (padded to 8)
                  context_dense f32[F_ctx]                                    (padded to 8)
                  dense f32[num_rows * F_row]                                 (padded to 8)
                  labels f32[num_rows] if flagged                             (padded to 8)

``decode`` validates everything in one compiled pass before any array is built: header fields and
limits, the exact total size (so truncated and oversized blobs fail before a read), the checksum,
slot flags, per-slot counts, strictly increasing signs, every index in range, monotone offsets
ending at the value count, and finite floats. Every failure is a ``CodecError`` naming the problem.
The arrays of the returned batch are zero-copy views of the input buffer.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from numpy.typing import DTypeLike, NDArray

from features.batch import CompactBatch
from features.xxh64 import Int
from features.xxh64 import read64 as _u64
from features.xxh64 import xxh64 as _xxh64

MAGIC = b"RSCB"
VERSION = 1
HEADER_SIZE = 48
MAX_SLOTS = 4096
MAX_ROWS = 1 << 24
MAX_DENSE = 1 << 16
FLAG_LABELS = 1
FLAG_HAS_CONTEXT = 2
_HEADER = struct.Struct("<4sHHQQIIIIB7x")


class CodecError(ValueError):
    """A blob that is not a valid compact batch; the message says what is wrong."""


def _pad8(n: int) -> int:
    return (n + 7) & ~7


I64 = np.int64
Buf = NDArray[np.uint8]
_Result = tuple[int, I64, I64, I64, I64, I64, I64, I64, I64, I64, I64]  # what _validate returns


# --- decode: one compiled validation pass -----------------------------------------------------
@numba.njit(inline="always")
def _u32(buf: Buf, i: Int) -> I64:
    return (
        np.int64(buf[i])
        | (np.int64(buf[i + 1]) << 8)
        | (np.int64(buf[i + 2]) << 16)
        | (np.int64(buf[i + 3]) << 24)
    )


@numba.njit(inline="always")
def _idx(buf: Buf, i: Int, width: Int) -> I64:
    if width == 1:
        return np.int64(buf[i])
    if width == 2:
        return np.int64(buf[i]) | (np.int64(buf[i + 1]) << 8)
    return _u32(buf, i)


@numba.njit(inline="always")
def _finite(buf: Buf, start: Int, count: Int) -> int:
    for k in range(count):
        p = start + 4 * k
        if (buf[p + 3] & 0x7F) == 0x7F and (buf[p + 2] & 0x80) == 0x80:
            return k
    return -1


@numba.njit(inline="always")
def _err(code: int, a: Int, b: Int, c: Int) -> _Result:
    z = np.int64(0)
    return code, np.int64(a), np.int64(b), np.int64(c), z, z, z, z, z, z, z


@numba.njit(cache=True)
def _validate(buf: Buf) -> _Result:
    """Return (code, a, b, total_signs, total_values, total_offsets, section starts...);
    code 0 means valid."""
    n = len(buf)
    z = np.int64(0)
    if n < 48:
        return _err(1, n, z, z)
    if buf[0] != 82 or buf[1] != 83 or buf[2] != 67 or buf[3] != 66:  # b"RSCB"
        return _err(2, z, z, z)
    version = np.int64(buf[4]) | (np.int64(buf[5]) << 8)
    if version != 1:
        return _err(3, version, z, z)
    hflags = np.int64(buf[6]) | (np.int64(buf[7]) << 8)
    if hflags & ~3:
        return _err(4, hflags, z, z)
    rows, nslots, ndense, nctx, width = (
        _u32(buf, 24),
        _u32(buf, 28),
        _u32(buf, 32),
        _u32(buf, 36),
        np.int64(buf[40]),
    )
    if width != 1 and width != 2 and width != 4:
        return _err(5, width, z, z)
    for k in range(41, 48):
        if buf[k] != 0:
            return _err(6, np.int64(k), z, z)
    if nslots > 4096:
        return _err(7, np.int64(0), nslots, z)
    if rows > (1 << 24):
        return _err(7, np.int64(1), rows, z)
    if ndense > (1 << 16) or nctx > (1 << 16):
        return _err(7, 2, max(ndense, nctx), z)
    table_end = 48 + ((9 * nslots + 7) & ~7)
    if n < table_end:
        return _err(8, table_end, n, z)
    if nctx > 0 and not (hflags & 2):
        return _err(12, np.int64(-1), z, z)
    tsigns = z
    tvalues = z
    toffsets = z
    for s in range(nslots):
        ns = _u32(buf, 48 + 4 * s)
        nv = _u32(buf, 48 + 4 * nslots + 4 * s)
        f = np.int64(buf[48 + 8 * nslots + s])
        if f & ~3:
            return _err(11, np.int64(s), f, z)
        if (f & 1) and not (hflags & 2):
            return _err(12, np.int64(s), z, z)
        srows = np.int64(1) if f & 1 else rows
        if f & 2:
            toffsets += srows + 1
        elif nv != srows:
            return _err(13, np.int64(s), nv, srows)
        if ns > nv or (nv > 0 and ns == 0):
            return _err(14, np.int64(s), ns, nv)
        tsigns += ns
        tvalues += nv
    p_signs = table_end
    p_values = p_signs + 8 * tsigns
    p_offsets = p_values + ((width * tvalues + 7) & ~7)
    p_ctx = p_offsets + ((4 * toffsets + 7) & ~7)
    p_dense = p_ctx + ((4 * nctx + 7) & ~7)
    p_labels = p_dense + ((4 * rows * ndense + 7) & ~7)
    end = p_labels + (((4 * rows + 7) & ~7) if hflags & 1 else 0)
    if end != n:
        return _err(9, end, np.int64(n), z)
    if _xxh64(buf[16:], n - 16, np.uint64(0)) != _u64(buf, 8):
        return _err(10, z, z, z)
    # padding must be zero, so every accepted blob is the canonical encoding of its batch
    pads = (48 + 9 * nslots, table_end, p_values + width * tvalues, p_offsets, p_offsets + 4 * toffsets, p_ctx,
            p_ctx + 4 * nctx, p_dense, p_dense + 4 * rows * ndense, p_labels, p_labels + 4 * rows, end)  # fmt: skip
    for k in range(0, 12 if hflags & 1 else 10, 2):
        for q in range(pads[k], pads[k + 1]):
            if buf[q] != 0:
                return _err(19, q, z, z)
    # content: per slot sorted unique signs, indices in range, offsets monotone
    ps = p_signs
    pv = p_values
    po = p_offsets
    for s in range(nslots):
        ns = _u32(buf, 48 + 4 * s)
        nv = _u32(buf, 48 + 4 * nslots + 4 * s)
        f = np.int64(buf[48 + 8 * nslots + s])
        prev = _u64(buf, ps)
        for k in range(1, ns):
            cur = _u64(buf, ps + 8 * k)
            if cur <= prev:
                return _err(15, np.int64(s), np.int64(k), z)
            prev = cur
        for k in range(nv):
            v = _idx(buf, pv + width * k, width)
            if v >= ns:
                return _err(16, np.int64(s), v, ns)
        if f & 2:
            srows = np.int64(1) if f & 1 else rows
            if _u32(buf, po) != 0:
                return _err(17, np.int64(s), z, z)
            last = z
            for k in range(1, srows + 1):
                o = _u32(buf, po + 4 * k)
                if o < last:
                    return _err(17, np.int64(s), np.int64(k), z)
                last = o
            if last != nv:
                return _err(17, np.int64(s), srows, z)
            po += 4 * (srows + 1)
        ps += 8 * ns
        pv += width * nv
    for section, start, count in (
        (0, p_ctx, nctx),
        (1, p_dense, rows * ndense),
        (2, p_labels, rows if hflags & 1 else z),
    ):
        bad = _finite(buf, start, count)
        if bad >= 0:
            return _err(18, np.int64(section), np.int64(bad), z)
    return 0, z, z, tsigns, tvalues, toffsets, p_values, p_offsets, p_ctx, p_dense, p_labels


_LIMIT_NAMES = ("num_slots", "num_rows", "dense columns")
_LIMITS = (MAX_SLOTS, MAX_ROWS, MAX_DENSE)


def _message(code: int, a: Int, b: Int, c: Int) -> str:
    messages: dict[int, Callable[[], str]] = {
        1: lambda: f"truncated: {a} bytes is shorter than the {HEADER_SIZE}-byte header",
        2: lambda: "bad magic: not a compact batch",
        3: lambda: f"unknown version {a} (this decoder reads version {VERSION})",
        4: lambda: f"unknown header flags 0x{a:x}",
        5: lambda: f"index width {a} is not 1, 2 or 4",
        6: lambda: f"reserved header byte {a} is not zero",
        7: lambda: f"{_LIMIT_NAMES[a]} {b} exceeds the limit {_LIMITS[a]}",
        8: lambda: f"truncated: slot table needs {a} bytes, blob has {b}",
        9: lambda: f"size mismatch: header and counts describe {a} bytes, blob has {b}",
        10: lambda: "checksum mismatch: the blob is corrupt",
        11: lambda: f"slot {a}: unknown slot flags 0x{b:x}",
        12: lambda: f"slot {a}: context data in a batch without a request context",
        13: lambda: f"slot {a}: single-valued slot has {b} values for {c} rows",
        14: lambda: f"slot {a}: {b} signs for {c} values",
        15: lambda: f"slot {a}: signs not strictly increasing at position {b}",
        16: lambda: f"slot {a}: index {b} out of range for {c} signs",
        17: lambda: f"slot {a}: offsets not monotone from 0 to the value count (at {b})",
        18: lambda: f"non-finite float in {('context_dense', 'dense', 'labels')[a]} at element {b}",
        19: lambda: f"non-zero padding byte at offset {a}",
    }
    return messages[code]()


_IDX_DTYPES: dict[int, np.dtype[np.unsignedinteger[Any]]] = {
    1: np.dtype("<u1"),
    2: np.dtype("<u2"),
    4: np.dtype("<u4"),
}


class _DecodedBatch(CompactBatch):
    """A validated blob seen as a CompactBatch. Arrays are zero-copy views created on first
    access (each costs ~0.4 us; a small request touches them only where it needs them). mypy
    takes a cached_property for a read-only one (hence ``ignore[override]``); it is writable,
    like the dataclass field it stands for."""

    def __init__(
        self, data: bytes | bytearray | memoryview, header: tuple[Any, ...], layout: tuple[I64, ...]
    ) -> None:
        _, _, hflags, _, shash, self.num_rows, self._nslots, self._ndense, nctx, width = header
        self._data, self._layout, self._nctx, self._width = data, layout, nctx, width
        self.has_context = bool(hflags & FLAG_HAS_CONTEXT)
        self._has_labels = bool(hflags & FLAG_LABELS)
        self.schema_hash = shash

    @functools.cached_property
    def sign_counts(self) -> NDArray[Any]:  # type: ignore[override]
        return np.frombuffer(self._data, "<u4", self._nslots, HEADER_SIZE)

    @functools.cached_property
    def value_counts(self) -> NDArray[Any]:  # type: ignore[override]
        return np.frombuffer(self._data, "<u4", self._nslots, HEADER_SIZE + 4 * self._nslots)

    @functools.cached_property
    def flags(self) -> NDArray[Any]:  # type: ignore[override]
        return np.frombuffer(self._data, np.uint8, self._nslots, HEADER_SIZE + 8 * self._nslots)

    @functools.cached_property
    def signs(self) -> NDArray[Any]:  # type: ignore[override]
        return np.frombuffer(self._data, "<u8", self._layout[0], HEADER_SIZE + _pad8(9 * self._nslots))

    @functools.cached_property
    def values(self) -> NDArray[Any]:  # type: ignore[override]
        return np.frombuffer(self._data, _IDX_DTYPES[self._width], self._layout[1], self._layout[3])

    @functools.cached_property
    def offsets(self) -> NDArray[Any]:  # type: ignore[override]
        return np.frombuffer(self._data, "<u4", self._layout[2], self._layout[4])

    @functools.cached_property
    def context_dense(self) -> NDArray[Any]:  # type: ignore[override]
        return np.frombuffer(self._data, "<f4", self._nctx, self._layout[5])

    @functools.cached_property
    def dense(self) -> NDArray[Any]:  # type: ignore[override]
        rows, nd = self.num_rows, self._ndense
        return np.frombuffer(self._data, "<f4", rows * nd, self._layout[6]).reshape(rows, nd)

    @functools.cached_property
    def labels(self) -> NDArray[Any] | None:  # type: ignore[override]
        return np.frombuffer(self._data, "<f4", self.num_rows, self._layout[7]) if self._has_labels else None


def decode(data: bytes | bytearray | memoryview, schema_hash: int | None = None) -> CompactBatch:
    """Validate a compact batch completely, then view it. Raises ``CodecError`` and nothing else.

    ``schema_hash``: when given (and the blob names one), the blob must have been built for it."""
    try:
        buf = np.frombuffer(data, dtype=np.uint8)
    except (TypeError, ValueError) as e:
        raise CodecError(f"not a byte buffer: {e}") from None
    code, a, b, c, *layout = _validate(buf)
    if code:
        raise CodecError(_message(code, a, b, c))
    header = _HEADER.unpack_from(data)
    shash = header[4]
    if schema_hash and shash and shash != schema_hash:
        raise CodecError(f"batch was built for schema {shash:016x}, this model expects {schema_hash:016x}")
    return _DecodedBatch(data, header, (c, *layout))


# --- encode -------------------------------------------------------------------------------------
def _check_encodable(b: CompactBatch) -> None:
    s = len(b.flags)
    if not (len(b.sign_counts) == len(b.value_counts) == s):
        raise CodecError("flags, sign_counts and value_counts differ in length")
    if s > MAX_SLOTS or b.num_rows > MAX_ROWS or b.dense.ndim != 2 or b.dense.shape[0] != b.num_rows:
        raise CodecError("batch exceeds codec limits or dense has the wrong shape")
    if b.values.dtype.itemsize not in (1, 2, 4) or b.values.dtype.kind != "u":
        raise CodecError(f"values dtype {b.values.dtype} is not uint8/16/32")
    if len(b.signs) != int(b.sign_counts.sum()) or len(b.values) != int(b.value_counts.sum()):
        raise CodecError("signs/values lengths disagree with their counts")
    if len(b.context_dense) and not b.has_context:
        raise CodecError("context_dense given in a batch without a request context")


def encode(batch: CompactBatch) -> bytes:
    """Serialise a batch. The result always passes ``decode``'s validation for a valid batch."""
    _check_encodable(batch)
    rows, s = batch.num_rows, len(batch.flags)
    hflags = (FLAG_LABELS if batch.labels is not None else 0) | (FLAG_HAS_CONTEXT if batch.has_context else 0)

    def padded(arr: NDArray[Any], dtype: DTypeLike) -> bytes:
        raw = np.ascontiguousarray(arr, dtype=dtype).tobytes()
        return raw + b"\0" * (_pad8(len(raw)) - len(raw))

    parts = [
        _HEADER.pack(
            MAGIC,
            VERSION,
            hflags,
            0,
            batch.schema_hash,
            rows,
            s,
            batch.dense.shape[1],
            len(batch.context_dense),
            batch.values.dtype.itemsize,
        ),  # fmt: skip
        padded(
            np.concatenate(
                [
                    np.asarray(batch.sign_counts, "<u4").view(np.uint8),
                    np.asarray(batch.value_counts, "<u4").view(np.uint8),
                    np.asarray(batch.flags, np.uint8),
                ]  # fmt: skip
            ),
            np.uint8,
        ),
        padded(batch.signs, "<u8"),
        padded(batch.values, batch.values.dtype.newbyteorder("<")),
        padded(batch.offsets, "<u4"),
        padded(batch.context_dense, "<f4"),
        padded(batch.dense, "<f4"),
        padded(batch.labels, "<f4") if batch.labels is not None else b"",
    ]
    out = bytearray(b"".join(parts))
    struct.pack_into(
        "<Q", out, 8, int(_xxh64(np.frombuffer(out, np.uint8)[16:], len(out) - 16, np.uint64(0)))
    )
    blob = bytes(out)
    code, a, b, c, *_ = _validate(np.frombuffer(blob, np.uint8))
    if code:  # an invalid batch object must not produce a blob that peers would reject later
        raise CodecError(f"cannot encode an invalid batch: {_message(code, a, b, c)}")
    return blob
