"""The memory of a training shard at one capacity: where each sign's row is (``SignIndex``) and
the rows with their per-row data (``RowArrays``), dense: positions 0..n-1 hold the n rows.

Both are allocated for a capacity and replaced whole when the store grows (``growth``); the
store's lock guards them. There are no per-ID Python objects: every batch operation is a numba
kernel (``index``) or whole-array numpy. A row's place in them is its *position* (``row_at``): ``keys[row_at]`` is its
sign, ``RowArrays.values[row_at]`` its row, and the index's table entries point at positions.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from features.hashing import has_duplicates
from model_store.shards import ShardData
from serving.ps import index, optim
from serving.ps.config import TableShardConfig, as_signs

__all__ = ["RowArrays", "SignIndex", "checked_assign", "checked_grads", "coalesce", "zeros"]


MAPPED_BYTES = 1 << 20
"""Arrays of at least this many bytes are anonymous mappings of their own (``zeros``)."""
HUGE_BYTES = 4 << 20
"""Mapped arrays of at least this many bytes are advised transparent huge pages (numpy's own
threshold)."""


def zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """Zeros starting on a 64-byte boundary, so a row of 16 float32 is one cache line, not two.

    From ``MAPPED_BYTES`` up the array is an anonymous mapping of its own (``mmap``): its pages
    are zero until written and committed only then, and they go back to the system with the
    array. ``np.zeros`` gets them from glibc's allocator, which maps a large block only until the
    first one is freed, then raises its threshold to that size (up to 32 MB) and serves the next
    ones from its heap, cleared whole with a memset: once a process had replaced a version's
    tables, the next version's index, keys and per-row counts were resident in full and stayed in
    the heap (a streaming trainer's RSS rose by 20-55 MB at each full version it loaded, glibc's
    in-use bytes by 54 MB at one). Mapped arrays from ``HUGE_BYTES`` are advised transparent huge
    pages, as numpy advises its own: lookups touch random rows, and with 4 KiB pages most of them would also miss
    the TLB."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape))
    nbytes = count * dtype.itemsize
    if nbytes < MAPPED_BYTES:
        buf = np.zeros(nbytes + 64, dtype=np.uint8)
        offset = -buf.ctypes.data % 64
        return buf[offset : offset + nbytes].view(dtype).reshape(shape)
    try:  # page-aligned, zero until written; private: a fork's writes are its own
        m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    except OSError as e:  # as np.zeros says it (a shard's growth refuses on MemoryError)
        raise MemoryError(f"cannot map {nbytes} bytes for a {shape} {dtype} array: {e}") from e
    if nbytes >= HUGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(m, dtype=dtype, count=count).reshape(shape)


@dataclass(eq=False)
class SignIndex:
    """sign -> row position: ``index``'s open-addressing table of int32 entries over the signs in
    ``keys`` (the sign of position i is ``keys[i]``)."""

    table: NDArray[np.int32]
    keys: NDArray[np.uint64]
    bits: int
    """Bits of an entry that hold the position (``index.position_bits``)."""

    @classmethod
    def empty(cls, capacity: int) -> SignIndex:
        """An index of no signs, for ``capacity`` positions (zeroed lazily by the OS)."""
        table = zeros((index.table_size(capacity),), np.int32)
        table[:] = index.EMPTY
        return cls(table, zeros((capacity,), np.uint64), index.position_bits(capacity))

    @property
    def capacity(self) -> int:
        return len(self.keys)

    @property
    def nbytes(self) -> int:
        return self.table.nbytes + self.keys.nbytes

    def find(self, signs: NDArray[np.uint64]) -> NDArray[np.int32]:
        """The position of each sign, -1 where absent."""
        return index.find_positions(self.table, self.keys, signs, self.bits)

    def add(self, signs: NDArray[np.uint64], start: int) -> None:
        """Index distinct, absent ``signs`` at positions start, start+1, ... (their keys written)."""
        index.insert_new(self.table, self.keys, signs, start, self.bits)

    def fill(self, signs: NDArray[np.uint64]) -> None:
        """Index exactly ``signs`` (distinct), at positions 0, 1, ..."""
        self.keys[: len(signs)] = signs
        self.rebuild(len(signs))

    def rebuild(self, n: int) -> None:
        """Index ``keys[:n]`` afresh (a sign's position = its place in keys); they must be distinct."""
        dups = index.rebuild(self.table, self.keys, n, self.bits)
        assert dups == 0, "the keys of a consistent store are distinct"

    def remove(self, victims: NDArray[np.int64], n: int) -> tuple[np.ndarray, np.ndarray]:
        """Drop the signs at the sorted distinct positions ``victims`` of the first ``n`` and refill
        the holes from the tail: (src, dst) positions that every per-row array must move alike."""
        return index.remove_compact(self.table, self.keys, victims, n, self.bits)

    def gather(self, values: np.ndarray, signs: NDArray[np.uint64]) -> tuple[NDArray[np.float32], int]:
        """(float32 rows of ``signs`` from ``values``, zeros where absent; the misses). One
        compiled pass for float32 values (``index.gather_rows``)."""
        if values.dtype == np.float32:
            out = np.empty((len(signs), values.shape[1]), dtype=np.float32)
            return out, int(index.gather_rows(self.table, self.keys, values, signs, self.bits, out))
        rows_at = self.find(signs)
        missing = rows_at < 0
        out = values.take(np.where(missing, 0, rows_at), axis=0).astype(np.float32)
        out[missing] = 0.0
        return out, int(missing.sum())


@dataclass(eq=False)
class RowArrays:
    """Per position: the row (``config.dtype``), the optimizer state (float32, one matrix per state
    name), the last-touch time, the touch count and whether it changed since the last delta."""

    values: NDArray[np.floating[Any]]
    state: dict[str, NDArray[np.float32]]
    stamp: NDArray[np.uint32]
    count: NDArray[np.uint32]
    dirty: NDArray[np.bool_]

    @classmethod
    def allocate(cls, cfg: TableShardConfig, capacity: int) -> RowArrays:
        """Zeroed arrays for ``capacity`` rows (pages committed as rows arrive)."""
        return cls(
            zeros((capacity, cfg.dim), cfg.dtype),
            {name: zeros((capacity, cfg.dim), np.float32) for name in cfg.optimizer.state_names},
            zeros((capacity,), np.uint32),
            zeros((capacity,), np.uint32),
            zeros((capacity,), np.bool_),
        )

    def columns(self) -> list[np.ndarray]:
        """Every per-position array (what a move or a copy must touch)."""
        return [self.values, self.stamp, self.count, self.dirty, *self.state.values()]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.columns())

    def copy_prefix(self, other: RowArrays, keep: int) -> None:
        """Slots 0..keep-1 of ``other`` into this (larger) one."""
        for mine, theirs in zip(self.columns(), other.columns(), strict=True):
            mine[:keep] = theirs[:keep]

    def move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Slot src[i] -> dst[i] in every array (``SignIndex.remove``'s compaction)."""
        for arr in self.columns():
            arr[dst] = arr[src]

    def fresh(self, start: int, signs: NDArray[np.uint64], cfg: TableShardConfig, now: np.uint32) -> None:
        """New rows for ``signs`` at positions start, start+1, ...: initial values and state, touched
        now, never counted, dirty (the serving side must get the initial row too)."""
        end = start + len(signs)
        self.values[start:end] = index.init_rows(signs, cfg.dim, np.uint64(cfg.seed), cfg.init_scale)
        for name, arr in self.state.items():
            arr[start:end] = cfg.optimizer.initial_state(name)
        self.stamp[start:end] = now
        self.count[start:end] = 0
        self.dirty[start:end] = True

    def assign(self, rows_at: np.ndarray, values: np.ndarray, state: dict[str, np.ndarray]) -> None:
        """Set rows (and the state named in ``state``) computed elsewhere; marked dirty."""
        self.values[rows_at] = values
        for name, arr in state.items():
            self.state[name][rows_at] = arr
        self.dirty[rows_at] = True

    def touch(self, rows_at: np.ndarray, now: np.uint32) -> None:
        """A lookup used these rows: stamp them now and count it (saturating)."""
        self.stamp[rows_at] = now
        c = self.count[rows_at]
        self.count[rows_at] = c + (c < np.uint32(0xFFFFFFFF))

    def touch_gather(self, rows_at: np.ndarray, now: np.uint32) -> tuple[NDArray[np.float32], int]:
        """(float32 rows at ``rows_at``, zeros where -1; the misses), touching the found ones
        (``touch``), in one compiled pass; float32 values only."""
        out = np.empty((len(rows_at), self.values.shape[1]), dtype=np.float32)
        return out, int(index.touch_gather(rows_at, self.values, self.stamp, self.count, now, out))

    def update(
        self, rows_at: np.ndarray, grads: np.ndarray, cfg: optim.OptimizerSpec, step: int, now
    ) -> None:
        """One optimizer step of the rows at distinct ``rows_at`` with their (summed) ``grads``:
        gathered into float32, updated (``optim.apply``), scattered back, stamped and dirty."""
        params = self.values[rows_at].astype(np.float32)
        state = {name: arr[rows_at] for name, arr in self.state.items()}
        optim.apply(cfg, params, state, grads, step)
        self.values[rows_at] = params
        for name, arr in self.state.items():
            arr[rows_at] = state[name]
        self.stamp[rows_at] = now
        self.dirty[rows_at] = True

    def fill(self, n: int, data: ShardData, optimizer: optim.OptimizerSpec) -> None:
        """Slots 0..n-1 from a full dump, none dirty; the dump's optimizer state where it was
        written by the same optimizer, else the initial state."""
        self.values[:n] = data.rows
        same_optimizer = data.meta.optimizer == optimizer.name
        for name, arr in self.state.items():
            arr[:n] = data.state[name] if same_optimizer else optimizer.initial_state(name)
        self.stamp[:n] = data.stamp
        self.count[:n] = data.count
        self.dirty[:] = False

    def put(
        self, rows_at: np.ndarray, data: ShardData, ok: np.ndarray, optimizer: optim.OptimizerSpec
    ) -> None:
        """A delta's rows ``ok`` at ``rows_at``, not dirty (they are published already); their state
        where the delta was written by the same optimizer."""
        self.values[rows_at] = data.rows[ok]
        if data.meta.optimizer == optimizer.name:
            for name, arr in self.state.items():
                arr[rows_at] = data.state[name][ok]
        self.stamp[rows_at] = data.stamp[ok]
        self.count[rows_at] = data.count[ok]
        self.dirty[rows_at] = False


def checked_grads(signs, grads, dim: int) -> tuple[NDArray[np.uint64], NDArray[np.float32]]:
    """``apply_gradients``' input as arrays: uint64 signs, finite float32 (len(signs), dim) grads
    (a flat array is reshaped), or a ValueError naming what is wrong."""
    signs = as_signs(signs)
    grads = np.asarray(grads, dtype=np.float32)
    if grads.ndim == 1 and len(signs):
        grads = grads.reshape(len(signs), -1)
    if grads.shape != (len(signs), dim):
        raise ValueError(f"grads shape {grads.shape} != ({len(signs)}, {dim})")
    if not np.isfinite(grads).all():
        raise ValueError("grads contain NaN or Inf")
    return signs, grads


def checked_assign(
    signs, rows, state: dict[str, np.ndarray] | None, cfg: TableShardConfig
) -> tuple[NDArray[np.uint64], NDArray[np.float32], dict[str, NDArray[np.float32]]]:
    """``assign``'s input as arrays: distinct uint64 signs, finite float32 rows and state of
    shape (len(signs), dim), the state named among the optimizer's; else a ValueError."""
    signs = as_signs(signs)
    rows = np.asarray(rows, dtype=np.float32)
    want = (len(signs), cfg.dim)
    if rows.shape != want or not np.isfinite(rows).all():
        raise ValueError(f"rows must be finite float32 of shape {want}")
    state = {k: np.asarray(v, np.float32) for k, v in (state or {}).items()}
    names = cfg.optimizer.state_names
    if set(state) - set(names) or any(v.shape != want for v in state.values()):
        raise ValueError(
            f"state must be float32 {want} per name among {sorted(names)}; got "
            f"{ {k: v.shape for k, v in state.items()} }"
        )
    if has_duplicates(signs):
        raise ValueError("assign needs distinct signs")
    return signs, rows, state


def coalesce(signs: NDArray[np.uint64], grads: NDArray[np.float32]) -> tuple[np.ndarray, np.ndarray]:
    """(distinct signs ascending, their gradients summed in input order): ``index.segment_sum``
    when some sign repeats, else a reordering."""
    uniq, inverse = np.unique(signs, return_inverse=True)
    if len(uniq) < len(signs):
        return uniq, index.segment_sum(inverse.reshape(-1), grads, len(uniq))
    return uniq, grads[np.argsort(signs, kind="stable")]
