"""proto <-> numpy for the recserve.v1 payloads: signs as little-endian uint64 bytes, rows and
gradients as float32 (or float16) row-major bytes, the DType enum. Every decoder validates sizes
before it builds a view (a ``BadRequest`` naming the problem)."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from serving.rpc.errors import BadRequest

FLOAT32, FLOAT16 = 1, 2  # recserve.v1.DType (0 = unspecified = float32)


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
    raise BadRequest(f"unknown dtype {value}; use FLOAT32 (1) or FLOAT16 (2)")


def wire_dtype(name: str) -> int:
    if name not in ("float32", "float16"):
        raise ValueError(f"unknown dtype {name!r}; use float32 or float16")
    return FLOAT16 if name == "float16" else FLOAT32


def rows_to_bytes(rows: NDArray[np.floating[Any]], fp16: bool) -> bytes:
    return (rows.astype(np.float16) if fp16 else np.ascontiguousarray(rows, dtype="<f4")).tobytes()


def rows_from_bytes(payload: bytes, dtype: int, shape: tuple[int, ...]) -> NDArray[np.float32]:
    """float32 rows of ``shape`` (a read-only view of the payload when it was sent as float32)."""
    itemsize = 2 if dtype == FLOAT16 else 4
    want = int(np.prod(shape)) * itemsize
    if len(payload) != want:
        raise ValueError(f"payload is {len(payload)} bytes; expected {want} for shape {shape}")
    rows = np.frombuffer(payload, dtype="<f2" if dtype == FLOAT16 else "<f4").reshape(shape)
    return rows.astype(np.float32) if dtype == FLOAT16 else rows


def matrix_from_bytes(payload: bytes, n: int, dim: int, what: str = "grads") -> NDArray[np.float32]:
    """A float32 (n, dim) matrix sent row-major; the size is checked first."""
    want = n * dim * 4
    if len(payload) != want:
        raise BadRequest(
            f"{what} is {len(payload)} bytes; expected {want} (float32, {n} signs x dim {dim}, row-major)"
        )
    return np.frombuffer(payload, dtype="<f4").reshape(n, dim)
