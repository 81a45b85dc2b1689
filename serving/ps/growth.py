"""Memory of the PS store: allocation, growth and its limits (a mixin of ``EmbeddingStore``,
which owns the lock; every method here runs under it).

A store without an eviction policy grows when full: fresh arrays of about twice the capacity (or
what the batch needs; less than 2x where only that fits the memory limit), the occupied prefix of
every per-row array copied, the index rebuilt for the new table size and slot bits, and the
admission sketch widened. The new arrays are zeroed lazily by the OS, so the peak is about the
old arrays plus the copied rows and the new index, and growing from n rows costs O(n): amortised
O(1) per insert. Anything that cannot be had -- past ``max_memory_gb``, past the int32 slots of one
shard, or refused by the allocator -- raises ``CapacityError`` before the store changes.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from model_store.errors import CapacityError
from serving.ps import index
from serving.ps.config import MAX_ROWS, StoreConfig
from serving.ps.fields import StoreFields

__all__ = ["GIB", "StoreMemory", "sketch_width", "zeros"]

log = logging.getLogger("recserve.ps.store")

GIB = 1 << 30


def zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """np.zeros starting on a 64-byte boundary, so a row of 16 float32 is one cache line, not two
    (large allocations are only 16-byte aligned). numpy advises transparent huge pages for big
    arrays itself, which matters here: lookups touch random rows, and with 4 KiB pages most of
    them would also miss the TLB."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    buf = np.zeros(nbytes + 64, dtype=np.uint8)
    offset = -buf.ctypes.data % 64
    return buf[offset : offset + nbytes].view(dtype).reshape(shape)


def store_bytes(cfg: StoreConfig, cap: int) -> int:
    """The memory of a store of configuration ``cfg`` at capacity ``cap``: per row the 8-byte key,
    the row, the optimizer state, stamp, count and dirty byte, plus the index and the admission
    sketch (the planner sizes in-process tables with it too)."""
    per_row = 8 + cfg.dim * (np.dtype(cfg.dtype).itemsize + 4 * len(cfg.optimizer.state_names)) + 9
    sketch = 4 * 2 * sketch_width(cap) if cfg.min_count > 1 else 0
    return index.table_size(cap) * 4 + cap * per_row + sketch


def sketch_width(cap: int) -> int:
    """Columns of the admission sketch for ``cap`` rows (a power of two)."""
    return 1 << max(10, (cap - 1).bit_length())


class StoreMemory(StoreFields):
    """Allocation, growth and memory accounting of ``EmbeddingStore``."""

    def _allocate(self, cap: int) -> dict[str, Any]:
        """Fresh arrays for ``cap`` rows (zeroed lazily by the OS: pages are committed as rows
        arrive), the index empty."""
        cfg = self.config
        table = zeros((index.table_size(cap),), np.int32)
        table[:] = index.EMPTY
        return {
            "_table": table,
            "_keys": zeros((cap,), np.uint64),
            "_rows": zeros((cap, cfg.dim), cfg.dtype),
            "_state": {name: zeros((cap, cfg.dim), np.float32) for name in cfg.optimizer.state_names},
            "_stamp": np.zeros(cap, dtype=np.uint32),
            "_count": np.zeros(cap, dtype=np.uint32),
            "_dirty": np.zeros(cap, dtype=np.bool_),
        }

    def _install_arrays(self, arrays: dict[str, Any]) -> None:
        for name, value in arrays.items():
            setattr(self, name, value)
        self.capacity = len(self._keys)
        self._bits = index.slot_bits(self.capacity)

    def bytes_for(self, cap: int) -> int:
        """``memory_bytes`` of this store at capacity ``cap``."""
        return store_bytes(self.config, cap)

    def _limit_bytes(self) -> int:
        return int(self.config.max_memory_gb * GIB)

    def _grow(self, need: int, keep: int, double: bool = True) -> None:
        """Make room for ``need`` rows, keeping slots 0..keep-1 (0: the caller refills them):
        about 2x the capacity when ``double`` (amortised O(1) inserts), else exactly ``need``,
        less than 2x where only that fits the memory limit. Raises CapacityError, the store
        unchanged, when ``need`` cannot be had."""
        cfg, cap = self.config, self.capacity
        limit = self._limit_bytes()
        if need > MAX_ROWS:
            raise self._capacity_error(
                need, f"more than the {MAX_ROWS:,} rows one shard can index (int32 slots)"
            )
        if limit and self.bytes_for(need) > limit:
            raise self._capacity_error(
                need,
                f"they need {self.bytes_for(need) / GIB:.3g} GiB, past max_memory_gb={cfg.max_memory_gb:g}",
            )
        target = min(max(need, 2 * cap), MAX_ROWS) if double else need
        if limit and self.bytes_for(target) > limit:  # the largest capacity the limit allows
            lo, hi = need, target
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self.bytes_for(mid) <= limit else (lo, mid - 1)
            target = lo
        t0 = time.perf_counter()
        try:
            arrays = self._allocate(target)
            for name in ("_keys", "_rows", "_stamp", "_count", "_dirty"):
                arrays[name][:keep] = getattr(self, name)[:keep]
            for name, arr in arrays["_state"].items():
                arr[:keep] = self._state[name][:keep]
            bits = index.slot_bits(target)
            dups = index.rebuild(arrays["_table"], arrays["_keys"], keep, bits)
            assert dups == 0, "the keys of a consistent store are distinct"
            sketch = self._sketch
            if sketch is not None and sketch_width(target) > sketch.shape[1]:
                # cell j of the wider sketch covers the signs of old cell j % width: estimates
                # stay >= true counts (never under-admit), and get sharper from here on
                sketch = np.tile(sketch, (1, sketch_width(target) // sketch.shape[1]))
        except MemoryError:
            raise self._capacity_error(need, "the machine could not allocate it (MemoryError)") from None
        self._install_arrays(arrays)
        self._sketch = sketch
        self.grows += 1
        log.info(
            "shard %d grew from %d to %d rows (%d held, %.2f GiB) in %.2fs",
            cfg.shard, cap, target, keep, self.memory_bytes / GIB, time.perf_counter() - t0,
        )  # fmt: skip

    def _capacity_error(self, need: int, why: str) -> CapacityError:
        cfg = self.config
        return CapacityError(
            f"PS shard {cfg.shard}/{cfg.num_shards} cannot hold {need:,} rows ({self.rows:,} held, "
            f"capacity {self.capacity:,}, {self.memory_bytes / GIB:.3g} GiB): {why}. Rows are never "
            f"dropped without an eviction policy: add shards (--num-shards), raise --max-memory-gb, "
            f"or bound the table with --eviction lru|lfu (or --ttl-s / --min-count)"
        )

    @property
    def memory_bytes(self) -> int:
        """Bytes of every array the store holds (index, keys, rows, state, metadata, sketch)."""
        arrays: list[np.ndarray] = [
            self._table,
            self._keys,
            self._rows,
            self._stamp,
            self._count,
            self._dirty,
            *self._state.values(),
        ]
        if self._sketch is not None:
            arrays.append(self._sketch)
        return sum(a.nbytes for a in arrays)
