"""The embedding store of one PS shard: a plain class, no network.

Memory is allocated for ``capacity`` rows and kept dense: slots 0..rows-1 are occupied, so a
dump is a slice of each array. Per row: the 8-byte sign (``keys``), the row (float32 or float16),
the optimizer state (float32), a uint32 last-touch time, a uint32 touch count and a dirty byte;
plus the index, 4 bytes per table entry at load <= 0.6. There are no per-ID Python objects; the
batch paths are numba kernels (``index.py``) and whole-array numpy.

A full store never drops a row unless an eviction policy is configured. With ``eviction="none"``
(the default) it grows (``growth.py``): every array is reallocated at about twice the capacity (or
what the batch needs), the occupied prefix copied and the index rebuilt for the new size, all
under the lock, so inserts cost amortised O(1). Growth that would pass ``max_memory_gb`` or the
int32 slot limit, or that the machine cannot allocate, raises ``CapacityError`` and leaves the
store as it was. With ``lru``/``lfu`` the capacity is a bound; evictions are counted and logged.

All public methods take one lock, so a lookup sees a delta entirely or not at all, whether the
store is called in-process from several threads or from the gRPC server's event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from features.hashing import has_duplicates, unique_signs
from model_store.errors import CapacityError
from model_store.shards import StoreError
from serving.ps import index, optim
from serving.ps.config import StoreConfig, as_signs, check_holds
from serving.ps.growth import GIB, StoreMemory, sketch_width
from serving.ps.optim import OptimizerSpec
from serving.ps.persistence import ShardPersistence

__all__ = ["CapacityError", "EmbeddingStore", "OptimizerSpec", "StoreConfig", "StoreError"]

log = logging.getLogger("recserve.ps.store")

LOG_EVERY_S = 10.0  # eviction log lines: at most one per this many seconds, with running totals


class EmbeddingStore(StoreMemory, ShardPersistence):
    """Rows and optimizer state of one shard, addressed by uint64 sign."""

    def __init__(self, config: StoreConfig, clock: Callable[[], float] = time.time):
        self.config = config
        self.clock = clock
        self.capacity = config.capacity
        """Rows the arrays hold now (``config.capacity`` at first; growth raises it)."""
        self._sketch = None
        limit = self._limit_bytes()
        if limit and self.bytes_for(self.capacity) > limit:
            raise CapacityError(
                f"shard {config.shard}: capacity {self.capacity:,} rows needs "
                f"{self.bytes_for(self.capacity) / GIB:.3g} GiB, more than max_memory_gb="
                f"{config.max_memory_gb:g}; lower --capacity or raise --max-memory-gb"
            )
        self._install_arrays(self._allocate(self.capacity))
        if config.min_count > 1:
            self._sketch = np.zeros((4, sketch_width(self.capacity)), dtype=np.uint16)
        self._deleted = []
        self._lock = threading.RLock()
        self.rows = 0
        self.version = ""
        """Model-store version this shard serves ('' until loaded or set)."""
        self.delta_seq = -1
        """Sequence number of the last delta cut (training) or applied (serving); -1: none."""
        self.step = 0
        """Optimizer step count (Adam bias correction)."""
        self.hits = self.misses = self.evictions = self.expired = self.inserts = self.grows = 0
        self._evictions_logged = (-np.inf, 0)  # (monotonic time, evictions) of the last log line

    # ---- lookups -------------------------------------------------------------------------
    def lookup(self, signs, insert: bool = False, version: str = "") -> tuple[np.ndarray, int]:
        """Rows (float32, (n, dim), request order) for ``signs`` and the number answered with the
        default zero row. ``insert=True`` (training) gives unseen signs a row, subject to
        admission, and refreshes the touched rows' LRU/LFU metadata; serving never inserts.
        ``version``: the version the caller pins ("" = any); the store holds only its own."""
        out, misses, _ = self.rows_of(signs, insert, version)
        return out, misses

    def rows_of(
        self, signs, insert: bool = False, version: str = ""
    ) -> tuple[np.ndarray, int, tuple[str, int]]:
        """``lookup`` returning what answered as a value: rows, misses and the (version, delta seq)
        the rows are, read under the same lock."""
        signs = as_signs(signs)
        with self._lock:
            check_holds(self.config, version, [self.version] if self.version else [])
            if insert and self._rows.dtype == np.float32:  # admit, touch and gather by slot
                slots = self._admit(signs, touch=False)
                out = np.empty((len(signs), self.config.dim), dtype=np.float32)
                misses = int(index.touch_gather(slots, self._rows, self._stamp, self._count,
                                                np.uint32(self.clock()), out))  # fmt: skip
                return out, misses, (self.version, self.delta_seq)
            if insert:
                self._admit(signs)
            if self._rows.dtype == np.float32:
                out = np.empty((len(signs), self.config.dim), dtype=np.float32)
                misses = int(index.gather_rows(self._table, self._keys, self._rows, signs, self._bits, out))
            else:
                slots = index.find_slots(self._table, self._keys, signs, self._bits)
                missing = slots < 0
                out = self._rows.take(np.where(missing, 0, slots), axis=0).astype(np.float32)
                out[missing] = 0.0
                misses = int(missing.sum())
            if not insert:
                self.hits += len(signs) - misses
                self.misses += misses
            return out, misses, (self.version, self.delta_seq)

    def _admit(self, signs: np.ndarray, touch: bool = True) -> np.ndarray:
        """Insert the unseen ``signs`` admission lets in; their slots (-1: not admitted). With
        ``touch`` the found rows' stamp and count are refreshed here (else by the caller)."""
        slots = index.find_slots(self._table, self._keys, signs, self._bits)
        found = slots >= 0
        n_found = int(found.sum())
        self.hits += n_found
        self.misses += len(signs) - n_found
        hit_slots = slots[found]
        if n_found < len(signs):
            new, counts = np.unique(signs[~found], return_counts=True)
            if self._sketch is not None:
                seen = index.sketch_add(self._sketch, new, counts.astype(np.int64))
                new = new[seen >= self.config.min_count]
            if len(new):
                self._insert(new, protect=hit_slots)
                slots = index.find_slots(self._table, self._keys, signs, self._bits)
                hit_slots = slots[slots >= 0]
        if touch:
            self._stamp[hit_slots] = np.uint32(self.clock())
            c = self._count[hit_slots]
            self._count[hit_slots] = c + (c < np.uint32(0xFFFFFFFF))
        return slots

    def _insert(self, new: np.ndarray, protect: np.ndarray) -> None:
        """Give the distinct absent ``new`` signs rows: grow (eviction none) or evict first if
        the store is full."""
        free = self.capacity - self.rows
        if len(new) > free:
            if self.config.eviction == "none":
                self._grow(self.rows + len(new), keep=self.rows)
            else:
                self._evict(max(len(new) - free, int(self.capacity * self.config.evict_fraction)), protect)
                new = new[: self.capacity - self.rows]  # a batch larger than the free space: the rest waits
        start, k = self.rows, len(new)
        index.insert_new(self._table, self._keys, new, start, self._bits)
        end = start + k
        cfg = self.config
        self._rows[start:end] = index.init_rows(new, cfg.dim, np.uint64(cfg.seed), cfg.init_scale)
        for name, arr in self._state.items():
            arr[start:end] = cfg.optimizer.initial_state(name)
        self._stamp[start:end] = np.uint32(self.clock())
        self._count[start:end] = 0
        self._dirty[start:end] = True  # the serving side must get the initial row too
        self.rows = end
        self.inserts += k

    # ---- eviction ------------------------------------------------------------------------
    def _evict(self, k: int, protect: np.ndarray) -> None:
        n = self.rows
        stamp = self._stamp[:n].astype(np.uint64)
        count = self._count[:n].astype(np.uint64)
        if self.config.eviction == "lru":
            key = (stamp << np.uint64(32)) | count
        else:
            key = (count << np.uint64(32)) | stamp
        key[protect] = np.iinfo(np.uint64).max
        k = min(k, n - len(unique_signs(protect)))
        if k <= 0:
            return
        victims = np.argpartition(key, k - 1)[:k] if k < n else np.arange(n)
        self._remove(np.sort(victims))
        self.evictions += k
        now, (last, _) = time.monotonic(), self._evictions_logged
        if now - last >= LOG_EVERY_S:
            cfg = self.config
            since = self.evictions - self._evictions_logged[1]
            self._evictions_logged = (now, self.evictions)
            log.info(
                "shard %d: %d rows evicted (%s at capacity %d), %d since the last report, %d held",
                cfg.shard, self.evictions, cfg.eviction, self.capacity, since, self.rows,
            )  # fmt: skip

    def expire(self, now: float | None = None) -> int:
        """Remove rows untouched for ``ttl_s`` seconds; returns how many."""
        if self.config.ttl_s <= 0:
            return 0
        with self._lock:
            now = self.clock() if now is None else now
            cutoff = now - self.config.ttl_s
            victims = np.flatnonzero(self._stamp[: self.rows] < cutoff)
            if len(victims):
                self._remove(victims)
                self.expired += len(victims)
            return len(victims)

    def _remove(self, victims: np.ndarray) -> None:
        """Delete the rows at sorted distinct slots, record their signs for the next delta and
        refill the holes from the tail so rows stay dense."""
        self._deleted.append(self._keys[victims].copy())
        src, dst = index.remove_compact(
            self._table, self._keys, victims.astype(np.int64), self.rows, self._bits
        )
        for arr in (self._rows, self._stamp, self._count, self._dirty, *self._state.values()):
            arr[dst] = arr[src]
        self.rows -= len(victims)

    # ---- training ------------------------------------------------------------------------
    def assign(self, signs, rows, state: dict[str, np.ndarray] | None = None) -> int:
        """Set rows to given values (inserting absent signs, bypassing admission) and mark them for
        the next delta: for rows computed elsewhere (a trainer's replicated tables, imports,
        tests). ``state``: their optimizer state by name (this store's optimizer's; None: left as
        it is, a new row's initial). Returns rows written."""
        signs = as_signs(signs)
        rows = np.asarray(rows, dtype=np.float32)
        want = (len(signs), self.config.dim)
        if rows.shape != want or not np.isfinite(rows).all():
            raise ValueError(f"rows must be finite float32 of shape {want}")
        state = {k: np.asarray(v, np.float32) for k, v in (state or {}).items()}
        if set(state) - set(self._state) or any(v.shape != want for v in state.values()):
            raise ValueError(
                f"state must be float32 {want} per name among {sorted(self._state)}; got "
                f"{ {k: v.shape for k, v in state.items()} }"
            )
        if has_duplicates(signs):
            raise ValueError("assign needs distinct signs")
        with self._lock:
            slots = index.find_slots(self._table, self._keys, signs, self._bits)
            absent = slots < 0
            if absent.any():
                self._insert(signs[absent], protect=slots[~absent])
                slots = index.find_slots(self._table, self._keys, signs, self._bits)
            ok = slots >= 0
            self._rows[slots[ok]] = rows[ok]
            for name, values in state.items():
                self._state[name][slots[ok]] = values[ok]
            self._dirty[slots[ok]] = True
            return int(ok.sum())

    def apply_gradients(self, signs, grads, step: int = 0, distinct: bool = False) -> int:
        """Apply gradients (float32, (n, dim)) with the store's optimizer; duplicate signs are
        summed first (``distinct``: the caller knows there are none); signs without a row (never
        admitted, or evicted) are skipped. ``step`` is the optimizer step for Adam (0: count
        locally). Returns the distinct signs updated."""
        signs = as_signs(signs)
        grads = np.asarray(grads, dtype=np.float32)
        if grads.ndim == 1 and len(signs):
            grads = grads.reshape(len(signs), -1)
        if grads.shape != (len(signs), self.config.dim):
            raise ValueError(f"grads shape {grads.shape} != ({len(signs)}, {self.config.dim})")
        if not np.isfinite(grads).all():
            raise ValueError("grads contain NaN or Inf")
        if not len(signs):
            return 0
        cfg = self.config.optimizer
        if distinct and cfg.name in index.FUSED and self._rows.dtype == np.float32:
            eps = (1e-10 if cfg.eps is None else cfg.eps) if cfg.name == "adagrad" else 0.0
            with self._lock:  # find + update in one compiled pass
                self.step = step if step else self.step + 1
                acc = self._state.get("sum", self._rows)  # SGD has no state: any (cap, dim) array
                return int(index.update_rows(
                    self._table, self._keys, self._bits, self._rows, acc, signs,
                    np.ascontiguousarray(grads), index.FUSED[cfg.name], cfg.lr, eps, self._stamp,
                    np.uint32(self.clock()), self._dirty,
                ))  # fmt: skip
        uniq, inverse = np.unique(signs, return_inverse=True)
        summed = index.segment_sum(inverse.reshape(-1), grads, len(uniq)) if len(uniq) < len(signs) else None
        if summed is None:
            summed = grads[np.argsort(signs, kind="stable")]
        with self._lock:
            self.step = step if step else self.step + 1
            slots = index.find_slots(self._table, self._keys, uniq, self._bits)
            ok = slots >= 0
            slots, g = slots[ok], summed[ok]
            params = self._rows[slots].astype(np.float32)
            state = {name: arr[slots] for name, arr in self._state.items()}
            optim.apply(self.config.optimizer, params, state, g, self.step)
            self._rows[slots] = params
            for name, arr in self._state.items():
                arr[slots] = state[name]
            self._stamp[slots] = np.uint32(self.clock())
            self._dirty[slots] = True
            return len(slots)

    # ---- persistence ---------------------------------------------------------------------
    # ---- introspection -------------------------------------------------------------------
    @property
    def raw_bytes_per_row(self) -> int:
        """8-byte key + row + optimizer state: the floor any layout must pay per row."""
        cfg = self.config
        return 8 + cfg.dim * (np.dtype(cfg.dtype).itemsize + 4 * len(self._state))

    def stats(self) -> dict:
        with self._lock:
            cfg = self.config
            return {
                "shard": cfg.shard,
                "num_shards": cfg.num_shards,
                "dim": cfg.dim,
                "dtype": cfg.dtype,
                "rows": self.rows,
                "capacity": self.capacity,
                "memory_bytes": self.memory_bytes,
                "hits": self.hits,
                "misses": self.misses,
                "inserts": self.inserts,
                "evictions": self.evictions,
                "expired": self.expired,
                "grows": self.grows,
                "eviction": cfg.eviction,
                "optimizer": cfg.optimizer.name,
                "step": self.step,
                "version": self.version,
                "delta_seq": self.delta_seq,
            }

    def __len__(self) -> int:
        return self.rows

    def __contains__(self, sign) -> bool:
        s = as_signs([sign])
        with self._lock:
            return bool(index.find_slots(self._table, self._keys, s, self._bits)[0] >= 0)


def warm_up(cfg: StoreConfig) -> None:
    """A training shard: load every compiled kernel the RPCs use (from numba's cache) for the
    read-only arrays that protobuf payloads give, so the first real call is not the slow one. A
    serving shard has nothing to warm up: its lookups are numpy."""
    signs = np.frombuffer(np.array([1, 2, 2, 3], dtype="<u8").tobytes(), dtype="<u8")
    scratch = EmbeddingStore(
        replace(cfg.with_table(capacity=16, min_count=1, max_memory_gb=0.0), shard=0, num_shards=1)
    )
    grads = np.frombuffer(np.zeros((4, cfg.dim), dtype="<f4").tobytes(), dtype="<f4").reshape(4, cfg.dim)
    scratch.lookup(signs, insert=True)
    scratch.lookup(signs)
    scratch.apply_gradients(signs, grads)
    scratch.apply_gradients(signs[:1], grads[:1])
