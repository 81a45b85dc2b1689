"""serving/ps/arrays.py's ``zeros``: 64-byte aligned zeros; from ``MAPPED_BYTES`` up an anonymous
private mapping of its own (its pages go back to the system with it, wherever glibc's threshold
stands; one the system refuses is a MemoryError), below that numpy's."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest

from serving.ps.arrays import MAPPED_BYTES, zeros


def _mapping_of(a: np.ndarray) -> mmap.mmap | None:
    base: object = a
    while base is not None and not isinstance(base, mmap.mmap):
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    return base


def _maps_covering(a: np.ndarray) -> list[str]:
    """The lines of /proc/self/maps whose range holds the array's first byte."""
    at = a.ctypes.data
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= at < hi:
                out.append(line.strip())
    return out


@pytest.mark.parametrize(("shape", "dtype"), [((MAPPED_BYTES // 64 + 3, 16), np.float32), ((5, 16), np.float32),
                                               ((MAPPED_BYTES,), np.bool_), ((7,), np.uint64)])  # fmt: skip
def test_zeros_are_aligned_writable_zeros_of_the_shape(shape, dtype):
    a = zeros(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and a.flags.writeable and a.flags.c_contiguous
    assert a.ctypes.data % 64 == 0 and not a.any()
    a[-1] = 1
    assert a.sum() == (shape[1] if len(shape) > 1 else 1)


def test_a_big_array_is_a_private_mapping_of_its_own_and_a_small_one_is_not():
    big = zeros((MAPPED_BYTES // 4,), np.float32)
    m = _mapping_of(big)
    assert m is not None and len(m) == big.nbytes
    [line] = _maps_covering(big)
    lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
    # the kernel merges a new anonymous mapping with an adjacent one of the same flags, so the line
    # covering it may start below it (a fresh-clone run: 1 MiB below); the array starts on a page
    at = big.ctypes.data
    assert at % mmap.PAGESIZE == 0 and lo <= at and at + big.nbytes <= hi
    assert line.split()[1][3] == "p"  # private
    assert _mapping_of(zeros((MAPPED_BYTES // 4 - 16,), np.float32)) is None


def test_a_forked_child_writes_its_own_copy():
    a = zeros((MAPPED_BYTES,), np.uint8)
    pid = os.fork()
    if pid == 0:
        a[:] = 7
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert not a.any()


def test_a_mapping_the_system_refuses_is_a_memory_error_as_from_numpy():
    """A shard's growth turns a MemoryError into its clear refusal (serving/ps/growth.py)."""
    with pytest.raises(MemoryError, match="cannot map"):
        zeros((1 << 46, 16), np.float32)
