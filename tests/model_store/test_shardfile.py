"""A shard file's .npy header: numpy's canonical header read without ``ast.literal_eval``, the
same answer as numpy's own parser; anything else goes to numpy's parser or is refused."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from model_store.errors import StoreError
from model_store.shardfile import npy_header


def _saved(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.save(b, a)
    return b.getvalue()


def _numpy_says(head: bytes) -> tuple:
    bio = io.BytesIO(head)
    version = np.lib.format.read_magic(bio)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(bio)
    return shape, dtype, bio.tell()


@pytest.mark.parametrize(
    "a",
    [
        np.zeros((3, 16), np.float32),
        np.zeros(0, np.uint64),
        np.zeros(7, np.uint32),
        np.zeros((2, 2), ">f2"),
        np.zeros((5, 2), bool),
        np.zeros((), np.float64),
        np.zeros((4, 3), np.int8),
        np.zeros(2, "<U5"),
    ],  # fmt: skip
    ids=lambda a: f"{a.dtype.str}{a.shape}",
)
def test_the_header_reads_as_numpy_reads_it(a: np.ndarray) -> None:
    head = _saved(a)
    assert npy_header(Path("x.npy"), head) == _numpy_says(head)
    data = np.frombuffer(head, a.dtype, count=a.size, offset=npy_header(Path("x.npy"), head)[2])
    assert data.reshape(a.shape).tobytes() == a.tobytes()


def test_a_fortran_ordered_or_object_array_is_refused() -> None:
    with pytest.raises(StoreError, match="unsupported array layout"):
        npy_header(Path("f.npy"), _saved(np.asfortranarray(np.zeros((3, 4), np.float32))))
    with pytest.raises(StoreError, match="not a .npy array"):
        npy_header(Path("g.npy"), b"not numpy at all")
