"""How a training shard's memory grows, under its limits (``Growth``).

A store without an eviction policy grows when full: fresh arrays of about twice the capacity (or
what the batch needs; less than 2x where only that fits the memory limit), the occupied prefix of
every per-row array copied, the index rebuilt for the new table size and position bits, and the
admission sketch widened. The new arrays are zeroed lazily by the OS, so the peak is about the
old arrays plus the copied rows and the new index, and growing from n rows costs O(n): amortised
O(1) per insert. Anything that cannot be had -- past ``max_memory_gb``, past the int32 positions of one
shard, or refused by the allocator -- raises ``CapacityError`` before the store changes.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from model_store.errors import CapacityError
from serving.ps import index
from serving.ps.admission import Admission, sketch_width
from serving.ps.arrays import RowArrays, SignIndex
from serving.ps.config import MAX_ROWS, TableShardConfig

__all__ = ["GIB", "Growth", "store_bytes"]

log = logging.getLogger("recserve.ps.store")

GIB = 1 << 30


def store_bytes(cfg: TableShardConfig, cap: int) -> int:
    """The memory of a store of configuration ``cfg`` at capacity ``cap``: per row the 8-byte key,
    the row, the optimizer state, stamp, count and dirty byte, plus the index and the admission
    sketch (the planner sizes in-process tables with it too)."""
    per_row = 8 + cfg.dim * (np.dtype(cfg.dtype).itemsize + 4 * len(cfg.optimizer.state_names)) + 9
    sketch = 4 * 2 * sketch_width(cap) if cfg.min_count > 1 else 0
    return index.table_size(cap) * 4 + cap * per_row + sketch


class Growth:
    """Sizes and grown copies of one store's memory; counts the times it grew (``grows``)."""

    def __init__(self, config: TableShardConfig):
        self.config = config
        self.grows = 0

    def bytes_for(self, cap: int) -> int:
        """The store's ``memory_bytes`` at capacity ``cap``."""
        return store_bytes(self.config, cap)

    @property
    def limit_bytes(self) -> int:
        return int(self.config.max_memory_gb * GIB)

    def check(self, cap: int) -> None:
        """A new store of ``cap`` rows must fit the memory limit (raises CapacityError)."""
        cfg, limit = self.config, self.limit_bytes
        if limit and self.bytes_for(cap) > limit:
            raise CapacityError(
                f"shard {cfg.shard}: capacity {cap:,} rows needs {self.bytes_for(cap) / GIB:.3g} GiB, "
                f"more than max_memory_gb={cfg.max_memory_gb:g}; lower --capacity or raise --max-memory-gb"
            )

    def grow(
        self, signs: SignIndex, arrays: RowArrays, admission: Admission | None, need: int, keep: int,
        *, held: int, double: bool = True,
    ) -> tuple[SignIndex, RowArrays]:  # fmt: skip
        """Room for ``need`` rows: a new index and arrays holding positions 0..keep-1 of these (0: the
        caller refills them), about 2x the capacity when ``double`` (amortised O(1) inserts),
        else exactly ``need``, less than 2x where only that fits the memory limit; the admission
        sketch is widened along. Raises CapacityError naming the ``held`` rows, nothing changed,
        when ``need`` cannot be had."""
        cfg, cap, limit = self.config, signs.capacity, self.limit_bytes
        memory = signs.nbytes + arrays.nbytes + (admission.nbytes if admission else 0)
        if need > MAX_ROWS:
            raise self._error(
                need,
                held,
                cap,
                memory,
                f"more than the {MAX_ROWS:,} rows one shard can index (int32 row positions)",
            )
        if limit and self.bytes_for(need) > limit:
            why = f"they need {self.bytes_for(need) / GIB:.3g} GiB, past max_memory_gb={cfg.max_memory_gb:g}"
            raise self._error(need, held, cap, memory, why)
        target = min(max(need, 2 * cap), MAX_ROWS) if double else need
        if limit and self.bytes_for(target) > limit:  # the largest capacity the limit allows
            lo, hi = need, target
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self.bytes_for(mid) <= limit else (lo, mid - 1)
            target = lo
        t0 = time.perf_counter()
        try:
            grown, rows = SignIndex.empty(target), RowArrays.allocate(cfg, target)
            grown.keys[:keep] = signs.keys[:keep]
            grown.rebuild(keep)
            rows.copy_prefix(arrays, keep)
            sketch = admission.widened(target) if admission else None
        except MemoryError:
            raise self._error(
                need, held, cap, memory, "the machine could not allocate it (MemoryError)"
            ) from None
        if admission and sketch is not None:
            admission.install(sketch)
        self.grows += 1
        log.info(
            "shard %d grew from %d to %d rows (%d held, %.2f GiB) in %.2fs", cfg.shard, cap, target, keep,
            (grown.nbytes + rows.nbytes + (admission.nbytes if admission else 0)) / GIB, time.perf_counter() - t0,
        )  # fmt: skip
        return grown, rows

    def _error(self, need: int, held: int, cap: int, memory: int, why: str) -> CapacityError:
        cfg = self.config
        return CapacityError(
            f"PS shard {cfg.shard}/{cfg.num_shards} cannot hold {need:,} rows ({held:,} held, "
            f"capacity {cap:,}, {memory / GIB:.3g} GiB): {why}. Rows are never "
            f"dropped without an eviction policy: add shards (--num-shards), raise --max-memory-gb, "
            f"or bound the table with --eviction lru|lfu (or --ttl-s / --min-count)"
        )
