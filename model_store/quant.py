"""Serving row types -- one registry of row codecs -- and the row-wise int8 encoding and its one decoding.

A version's tables are trained in float32 (rows and optimizer state) and written in the serving
dtype the export chose (``serving.ps.spec.TableSpec.serving_dtype``; ``model_store.shards``
``ShardData.encoded``). Each serving dtype is one ``RowCodec`` in ``CODECS`` (``register``; a name
is looked up with ``row_codec``, which refuses one it does not hold): the array type of
``rows.npy``, whether each row carries a scale and bias (``qparams.npy``), its bytes a row, its
value in the wire enum (``recserve.v1.DType``), whether the planner may choose it, and its
``encode``/``decode`` pair. The dump, the serving table, the delta overlay, the gRPC payload, the
offline reader and the planner all ask it, so a new row type is one entry here (and its enum value
in proto/recserve/v1/common.proto). ``SERVING_DTYPES`` is its names; ``narrowing`` its order.

int8 is FBGEMM's 8-bit row-wise layout in two arrays: per row, D uint8
codes ``q`` (``rows.npy``) and an fp16 scale ``s`` and bias ``b`` (``qparams.npy``, (rows, 2)
float16); element j is ``b + q[j] * s``, computed in float32 (``dequantize``: the one decoding,
used by the serving PS, co-located lookups and offline scoring alike, so they read the same
values). D + 4 bytes a row: 20 at dim 16 against 64 in float32.

The bound, by construction (``quantize``): ``s`` is (max - min) / 255 rounded *up* to fp16, and
``b`` is the fp16 value nearest the middle of the biases for which the 256 codes cover [min, max]
to within s / 2 (an interval at least s wide). Every element is then within s / 2 of its float32
value: (max - min) / 510 up to fp16's rounding of the scale (a factor of at most 1 + 2**-10, or
3e-8 absolute for a scale below 6.1e-5, fp16's subnormals), plus the float32 rounding of
``b + q * s`` (``q * s`` is exact, the sum rounds once). One exception, by fp16's 11 significant
bits: a row nearly constant far from zero (spread under ~255 fp16 ulps of its values, about a
quarter of their magnitude) cannot place ``b`` that finely and errs by up to half an fp16 ulp of
its values. ``error_bound`` is this bound per row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

QPARAMS = np.dtype(np.float16)
"""Type of an int8 row's scale and bias (``qparams.npy``: (rows, 2), scale then bias)."""
FP16_MAX = 65504.0
CHUNK = 1 << 16  # rows quantized at once (float64 temporaries: 8 bytes x dim a row)

Encode = Callable[[NDArray[Any]], tuple[NDArray[Any], NDArray[np.float16] | None]]
"""``encode(float rows) -> (stored rows, qparams or None)``."""
Decode = Callable[[NDArray[Any], NDArray[np.float16] | None, NDArray[np.float32] | None], NDArray[np.float32]]
"""``decode(stored rows, qparams, out) -> float32 rows`` (into ``out`` when it is not None)."""


@dataclass(frozen=True)
class RowCodec:
    """One serving row type: how ``rows.npy`` holds a row, and its one encoding and decoding."""

    name: str
    """The serving dtype (``TableSpec.serving_dtype``, ``ShardMeta.row_dtype``, config choices)."""
    storage: np.dtype[Any]
    """The array type of ``rows.npy`` (and of a lookup answered as stored)."""
    wire: str
    """Its value's name in the ``recserve.v1.DType`` enum (proto/recserve/v1/common.proto)."""
    encode: Encode
    """``encode(float rows) -> (stored rows, qparams or None)``."""
    decode: Decode
    """``decode(stored rows, qparams, out) -> float32 rows`` (into ``out`` when not None): THE
    decoding, so every reader of a version gets the same float32 values."""
    qparams: bool = False
    """Each row carries an fp16 (scale, bias) beside its values (``qparams.npy``, (rows, 2))."""
    plain: bool = False
    """``storage`` is a float type numpy converts: decoding is a cast (a gather copies the rows
    straight into its float32 answer), and a shard asked for float16 lookups narrows such rows
    once (``BucketTable.astype``); codes of a non-plain type are never converted, only decoded."""
    planned: bool = True
    """The planner may choose it under a serving budget (``training.planning.serving_plan``);
    otherwise a table is served in it only where its plan pins it."""

    def bytes_per_row(self, dim: int) -> int:
        """Bytes of one row's values (and its qparams) at ``dim``."""
        return dim * self.storage.itemsize + (2 * QPARAMS.itemsize if self.qparams else 0)


CODECS: dict[str, RowCodec] = {}
"""The serving row types by name, in registration order."""


def register(codec: RowCodec) -> RowCodec:
    """Add ``codec`` to ``CODECS``; a name registered twice is refused."""
    if codec.name in CODECS:
        raise ValueError(f"serving dtype {codec.name!r} registered twice")
    CODECS[codec.name] = codec
    return codec


def row_codec(name: str) -> RowCodec:
    """The codec of serving dtype ``name``; a ValueError naming the choices otherwise."""
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown serving dtype {name!r}; choose {', '.join(CODECS)}") from None


def narrowing() -> list[RowCodec]:
    """The codecs widest first: by the bytes an element takes in ``rows.npy`` (float32, float16,
    int8; a tie in registration order). The planner narrows tables along it; a version's shards
    hold the narrowest type their tables were given (``ShardingPlan.serving_dtype``)."""
    return sorted(CODECS.values(), key=lambda c: -c.storage.itemsize)


def storage(dtype: str) -> np.dtype[Any]:
    """The array type of ``rows.npy`` for a serving dtype; ValueError naming the choices."""
    return row_codec(dtype).storage


def bytes_per_row(dim: int, dtype: str) -> int:
    """Bytes of one row's values in ``dtype`` (int8: D codes + fp16 scale and bias)."""
    return row_codec(dtype).bytes_per_row(dim)


SERVED_INDEX_BYTES = 1
"""A served row's share of its shard's bucket directory (4-byte offsets, 4-8 rows a bucket: 0.5-1)."""


def served_bytes_per_row(dim: int, dtype: str) -> int:
    """Memory a serving host spends on one row of a mapped version: its 8-byte key, its values
    (``bytes_per_row``) and its share of the directory (``SERVED_INDEX_BYTES``, rounded up).
    bench-scale measures 8 + values + 0.7-0.9 bytes (plus ~60 MB per serving process)."""
    return 8 + bytes_per_row(dim, dtype) + SERVED_INDEX_BYTES


def _up16(v: NDArray[np.float64]) -> NDArray[np.float16]:
    """The smallest fp16 value >= v."""
    f = v.astype(np.float16)
    under = f.astype(np.float64) < v
    f[under] = np.nextafter(f[under], np.float16(np.inf))
    return f


def quantize(rows: NDArray[np.floating[Any]]) -> tuple[NDArray[np.uint8], NDArray[np.float16]]:
    """(codes, qparams) of float rows (rows x dim): uint8 codes and fp16 (scale, bias) per row,
    vectorised a chunk of rows at a time. ValueError for rows outside fp16's range (or not finite)."""
    x = np.asarray(rows)
    n, dim = x.shape
    codes = np.empty((n, dim), np.uint8)
    qparams = np.empty((n, 2), QPARAMS)
    for i in range(0, n, CHUNK):
        codes[i : i + CHUNK], qparams[i : i + CHUNK] = _quantize(x[i : i + CHUNK].astype(np.float64))
    return codes, qparams


def _quantize(x: NDArray[np.float64]) -> tuple[NDArray[np.uint8], NDArray[np.float16]]:
    if not len(x):
        return np.empty(x.shape, np.uint8), np.empty((0, 2), QPARAMS)
    lo, hi = x.min(1), x.max(1)
    if not (np.isfinite(lo).all() and np.isfinite(hi).all()) or max(-lo.min(), hi.max()) >= FP16_MAX:
        raise ValueError(f"int8 rows need finite values of magnitude < {FP16_MAX:g} (fp16 scale and bias)")
    s = _up16((hi - lo) / 255)
    sf = s.astype(np.float64)
    # b in [hi - 255.5 s, lo + s/2] (at least s wide): codes 0..255 reach every element within s/2
    b = ((hi - 255.5 * sf + lo + 0.5 * sf) / 2).astype(np.float16)
    q = np.rint((x - b.astype(np.float64)[:, None]) / np.where(sf > 0, sf, 1.0)[:, None])
    return np.clip(q, 0, 255).astype(np.uint8), np.stack([s, b], axis=1)


def dequantize(
    codes: NDArray[np.uint8], qparams: NDArray[np.float16], out: NDArray[np.float32] | None = None
) -> NDArray[np.float32]:
    """float32 rows ``b + q * s`` of int8 ``codes`` and their ``qparams`` (into ``out`` if given):
    THE decoding, so every reader of a version gets the same float32 values."""
    qp = qparams.astype(np.float32)
    out = np.multiply(codes, qp[:, :1], out=out, dtype=np.float32)
    out += qp[:, 1:]
    return out


def _cast(
    rows: NDArray[Any], qparams: NDArray[np.float16] | None = None, out: NDArray[np.float32] | None = None
) -> NDArray[np.float32]:
    """A plain type's decoding: its rows widened to float32, exactly (into ``out`` if given)."""
    if out is None:
        return rows.astype(np.float32, copy=False)
    out[...] = rows
    return out


def _plain(kind: type[np.floating[Any]]) -> Encode:
    """The encoding into plain float type ``kind``: a cast."""

    def encode(rows: NDArray[Any]) -> tuple[NDArray[Any], NDArray[np.float16] | None]:
        return rows.astype(kind, copy=False), None

    return encode


def _int8_decode(
    codes: NDArray[Any], qparams: NDArray[np.float16] | None, out: NDArray[np.float32] | None = None
) -> NDArray[np.float32]:
    if qparams is None:
        raise ValueError("int8 rows need their qparams (scale and bias a row)")
    return dequantize(codes, qparams, out)


register(RowCodec("float32", np.dtype(np.float32), "FLOAT32", _plain(np.float32), _cast, plain=True))
register(RowCodec("float16", np.dtype(np.float16), "FLOAT16", _plain(np.float16), _cast, plain=True))
register(RowCodec("int8", np.dtype(np.uint8), "INT8", quantize, _int8_decode, qparams=True))

SERVING_DTYPES = tuple(CODECS)
"""Row types a version can be served in (``TableSpec.serving_dtype``): the registry's names."""


@dataclass(frozen=True)
class StoredRows:
    """Rows as a serving table holds them, not decoded: ``values`` (n, dim) in serving dtype
    ``dtype``'s storage (float32, float16, or int8's uint8 codes) and, for a type with qparams
    (int8), ``qparams`` (n, 2). What a serving PS answers over gRPC (``LookupRequest.stored``),
    decoded by the caller."""

    dtype: str
    """The serving dtype (a ``CODECS`` name)."""
    values: NDArray[Any]
    qparams: NDArray[np.float16] | None = None

    def decoded(self) -> NDArray[np.float32]:
        """float32 rows, by the dtype's one decoding (int8: ``dequantize``; float16: widened exactly)."""
        return row_codec(self.dtype).decode(self.values, self.qparams, None)


def error_bound(rows: NDArray[np.floating[Any]]) -> NDArray[np.float64]:
    """Per row, the most an element of ``dequantize(*quantize(rows))`` may differ from ``rows``
    (the module's bound): max((max - min) / 510 + half an fp16 ulp of the scale, half an fp16 ulp
    of the row's largest magnitude), plus the float32 rounding of ``b + q * s``."""
    x = np.asarray(rows, np.float64)
    lo, hi = x.min(1), x.max(1)
    mag = np.maximum(np.abs(lo), np.abs(hi))
    scale = (hi - lo) / 255
    bound: NDArray[np.float64] = np.maximum(scale / 2 + _half_ulp16(scale), _half_ulp16(mag))
    return np.asarray(bound + mag * 2.0**-23, np.float64)


def _half_ulp16(v: NDArray[np.float64]) -> NDArray[np.float64]:
    half: NDArray[np.float64] = np.spacing(np.abs(v).astype(np.float16)).astype(np.float64) / 2
    return half
