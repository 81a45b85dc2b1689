"""proto <-> numpy for the recserve.v1 payloads: signs as little-endian uint64 bytes, rows and
gradients as float32 (or float16) row-major bytes, rows answered as a shard stores them (float32,
float16, or int8 codes with their float16 scale and bias: ``model_store.quant.StoredRows``), the
DType enum (a serving dtype's value is the one its row codec names, ``RowCodec.wire``). Every
decoder validates sizes before it builds a view (a ``BadRequest`` naming the problem; a bad answer
is a ``ValueError``)."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from model_store.quant import CODECS, QPARAMS, StoredRows, row_codec
from recserve.v1 import common_pb2
from serving.rpc.errors import BadRequest

FLOAT32: int = common_pb2.FLOAT32  # recserve.v1.DType (0 = unspecified = float32)
FLOAT16: int = common_pb2.FLOAT16
WIRE: dict[str, int] = {name: common_pb2.DType.Value(c.wire) for name, c in CODECS.items()}
"""A serving dtype's DType on the wire."""
_NAMES = {value: name for name, value in WIRE.items()}


def signs_to_bytes(signs: ArrayLike) -> bytes:
    return np.ascontiguousarray(signs, dtype="<u8").tobytes()


def signs_from_bytes(payload: bytes) -> NDArray[np.uint64]:
    if not payload:
        raise BadRequest("empty request: no signs")
    if len(payload) % 8:
        raise BadRequest(f"signs is {len(payload)} bytes, not a multiple of 8 (uint64 little-endian)")
    return np.frombuffer(payload, dtype="<u8")


def wants_fp16(value: int) -> bool:
    """True for FLOAT16, False for FLOAT32 or unspecified; anything else is refused."""
    if value in (0, FLOAT32):
        return False
    if value == FLOAT16:
        return True
    raise BadRequest(
        f"unknown dtype {value}; use FLOAT32 (1) or FLOAT16 (2) (rows as a shard stores them, int8 "
        "included: a LookupRequest's stored=true)"
    )


def wire_dtype(name: str) -> int:
    """The DType a lookup asks its rows in: float32 or float16 (converted by the shard)."""
    if name not in ("float32", "float16"):
        raise ValueError(f"unknown dtype {name!r}; use float32, float16 or stored")
    return FLOAT16 if name == "float16" else FLOAT32


def rows_to_bytes(rows: NDArray[np.floating[Any]], fp16: bool) -> bytes:
    return (rows.astype(np.float16) if fp16 else np.ascontiguousarray(rows, dtype="<f4")).tobytes()


def stored_to_bytes(rows: StoredRows) -> tuple[int, bytes, bytes]:
    """(DType, rows, qparams) payloads of rows answered as stored (qparams: b"" unless int8's)."""
    qparams = b"" if rows.qparams is None else np.ascontiguousarray(rows.qparams, "<f2").tobytes()
    values = np.ascontiguousarray(rows.values, rows.values.dtype.newbyteorder("<"))
    return WIRE[rows.dtype], values.tobytes(), qparams


def stored_from_bytes(dtype: int, payload: bytes, qparams: bytes, shape: tuple[int, int]) -> StoredRows:
    """The rows of a LookupResponse (any DType) as ``StoredRows`` of ``shape`` (read-only views of
    the payloads; ``decoded()`` gives float32); ValueError naming a size that does not fit."""
    name = _NAMES.get(dtype or FLOAT32)
    if name is None:
        raise ValueError(f"unknown row dtype {dtype}")
    codec = row_codec(name)
    kind = codec.storage.newbyteorder("<")
    n = shape[0]
    if len(payload) != int(np.prod(shape)) * kind.itemsize:
        raise ValueError(f"rows are {len(payload)} bytes; expected {int(np.prod(shape)) * kind.itemsize} "
                         f"for {name} {shape}")  # fmt: skip
    values = np.frombuffer(payload, dtype=kind).reshape(shape)
    if not codec.qparams:
        if qparams:
            raise ValueError(f"{len(qparams)} bytes of qparams with {name} rows")
        return StoredRows(name, values)
    if len(qparams) != n * 2 * QPARAMS.itemsize:
        raise ValueError(f"qparams are {len(qparams)} bytes; expected {n * 4} for {n} {name} rows")
    return StoredRows(name, values, np.frombuffer(qparams, dtype="<f2").reshape(n, 2))


def matrix_from_bytes(payload: bytes, n: int, dim: int, what: str = "grads") -> NDArray[np.float32]:
    """A float32 (n, dim) matrix sent row-major; the size is checked first."""
    want = n * dim * 4
    if len(payload) != want:
        raise BadRequest(
            f"{what} is {len(payload)} bytes; expected {want} (float32, {n} signs x dim {dim}, row-major)"
        )
    return np.frombuffer(payload, dtype="<f4").reshape(n, dim)
