"""Serving row types: float32, float16 and row-wise int8 -- the int8 encoding and its one decoding.

A version's tables are trained in float32 (rows and optimizer state) and written in the serving
dtype the export chose (``serving.ps.spec.TableSpec.serving_dtype``; ``model_store.shards``
``ShardData.encoded``). int8 is FBGEMM's 8-bit row-wise layout in two arrays: per row, D uint8
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

from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

SERVING_DTYPES = ("float32", "float16", "int8")
"""Row types a version can be served in (``TableSpec.serving_dtype``)."""
STORAGE: dict[str, np.dtype[Any]] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "int8": np.dtype(np.uint8),
}
"""A serving dtype's array type in ``rows.npy`` (int8: uint8 codes, with ``qparams.npy``)."""
QPARAMS = np.dtype(np.float16)
"""Type of an int8 row's scale and bias (``qparams.npy``: (rows, 2), scale then bias)."""
FP16_MAX = 65504.0
CHUNK = 1 << 16  # rows quantized at once (float64 temporaries: 8 bytes x dim a row)


def storage(dtype: str) -> np.dtype[Any]:
    """The array type of ``rows.npy`` for a serving dtype; ValueError naming the choices."""
    try:
        return STORAGE[dtype]
    except KeyError:
        raise ValueError(f"unknown serving dtype {dtype!r}; choose {', '.join(SERVING_DTYPES)}") from None


def bytes_per_row(dim: int, dtype: str) -> int:
    """Bytes of one row's values in ``dtype`` (int8: D codes + fp16 scale and bias)."""
    return dim * storage(dtype).itemsize + (2 * QPARAMS.itemsize if dtype == "int8" else 0)


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


@dataclass(frozen=True)
class StoredRows:
    """Rows as a serving table holds them, not decoded: ``values`` (n, dim) in the serving dtype's
    storage (float32, float16, or int8's uint8 codes) and, for int8, ``qparams`` (n, 2). What a
    serving PS answers over gRPC (``LookupRequest.stored``), decoded by the caller."""

    values: NDArray[Any]
    qparams: NDArray[np.float16] | None = None

    @property
    def dtype(self) -> str:
        """The serving dtype: float32, float16 or int8."""
        return "int8" if self.qparams is not None else str(self.values.dtype)

    def decoded(self) -> NDArray[np.float32]:
        """float32 rows: int8 through ``dequantize`` (THE decoding), float16 widened exactly."""
        if self.qparams is not None:
            return dequantize(self.values, self.qparams)
        return self.values.astype(np.float32, copy=False)


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
