"""The embedding store of one PS shard: a plain class, no network.

Memory is preallocated at ``capacity`` rows and kept dense: slots 0..rows-1 are occupied, so a
dump is a slice of each array. Per row: the 8-byte sign (``keys``), the row (float32 or float16),
the optimizer state (float32), a uint32 last-touch time, a uint32 touch count and a dirty byte;
plus the index, 4 bytes per table entry at load <= 0.6. There are no per-ID Python objects; the
batch paths are numba kernels (``index.py``) and whole-array numpy.

All public methods take one lock, so a lookup sees a delta entirely or not at all, whether the
store is called in-process from several threads or from the gRPC server's event loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from model_store.shards import StoreError
from serving.ps import index, optim
from serving.ps.config import StoreConfig
from serving.ps.optim import OptimizerConfig
from serving.ps.persistence import ShardPersistence

__all__ = ["EmbeddingStore", "OptimizerConfig", "StoreConfig", "StoreError"]


def as_signs(signs) -> np.ndarray:
    """A contiguous uint64 array of signs (a view where possible)."""
    a = np.asarray(signs)
    if a.dtype != np.uint64:
        if a.dtype.kind == "i" and a.size and a.min() < 0:
            raise ValueError("signs must be non-negative (uint64)")
        a = a.astype(np.uint64)
    return np.ascontiguousarray(a.reshape(-1))


def _zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """np.zeros starting on a 64-byte boundary, so a row of 16 float32 is one cache line, not two
    (large allocations are only 16-byte aligned). numpy advises transparent huge pages for big
    arrays itself, which matters here: lookups touch random rows, and with 4 KiB pages most of
    them would also miss the TLB."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    buf = np.zeros(nbytes + 64, dtype=np.uint8)
    offset = -buf.ctypes.data % 64
    return buf[offset : offset + nbytes].view(dtype).reshape(shape)


class EmbeddingStore(ShardPersistence):
    """Rows and optimizer state of one shard, addressed by uint64 sign."""

    def __init__(self, config: StoreConfig, clock: Callable[[], float] = time.time):
        self.config = config
        self.clock = clock
        cap, dim = config.capacity, config.dim
        self._table = _zeros((index.table_size(cap),), np.int32)
        self._table[:] = index.EMPTY
        self._bits = index.slot_bits(cap)
        self._keys = _zeros((cap,), np.uint64)
        self._rows = _zeros((cap, dim), config.dtype)
        self._state = {name: _zeros((cap, dim), np.float32) for name in config.optimizer.state_names}
        self._stamp = np.zeros(cap, dtype=np.uint32)
        self._count = np.zeros(cap, dtype=np.uint32)
        self._dirty = np.zeros(cap, dtype=np.bool_)
        self._sketch = None
        if config.min_count > 1:
            width = 1 << max(10, (cap - 1).bit_length())
            self._sketch = np.zeros((4, width), dtype=np.uint16)
        self._deleted: list[np.ndarray] = []
        self._lock = threading.RLock()
        self.rows = 0
        self.version = ""
        """Model-store version this shard serves ('' until loaded or set)."""
        self.delta_seq = -1
        """Sequence number of the last delta cut (training) or applied (serving); -1: none."""
        self.last_lookup_version = ("", -1)
        """(version, delta_seq) of the rows the latest lookup returned, read under the same lock."""
        self.step = 0
        """Optimizer step count (Adam bias correction)."""
        self.hits = self.misses = self.evictions = self.expired = self.inserts = 0

    # ---- lookups -------------------------------------------------------------------------
    def lookup(self, signs, insert: bool = False) -> tuple[np.ndarray, int]:
        """Rows (float32, (n, dim), request order) for ``signs`` and the number answered with the
        default zero row. ``insert=True`` (training) gives unseen signs a row, subject to
        admission, and refreshes the touched rows' LRU/LFU metadata; serving never inserts."""
        signs = as_signs(signs)
        with self._lock:
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
            self.last_lookup_version = (self.version, self.delta_seq)  # what these rows are (under the lock)
            return out, misses

    def lookup_or_insert(self, signs) -> tuple[np.ndarray, int]:
        """Training lookup: ``lookup(signs, insert=True)``."""
        return self.lookup(signs, insert=True)

    def _admit(self, signs: np.ndarray) -> None:
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
        self._stamp[hit_slots] = np.uint32(self.clock())
        c = self._count[hit_slots]
        self._count[hit_slots] = c + (c < np.uint32(0xFFFFFFFF))

    def _insert(self, new: np.ndarray, protect: np.ndarray) -> None:
        """Give the distinct absent ``new`` signs rows, evicting first if the store is full."""
        cap = self.config.capacity
        if len(new) > cap - self.rows:
            need = len(new) - (cap - self.rows)
            self._evict(max(need, int(cap * self.config.evict_fraction)), protect)
            new = new[: cap - self.rows]  # a batch larger than the free space: the rest waits
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
        k = min(k, n - len(np.unique(protect)))
        if k <= 0:
            return
        victims = np.argpartition(key, k - 1)[:k] if k < n else np.arange(n)
        self._remove(np.sort(victims))
        self.evictions += k

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
    def assign(self, signs, rows) -> int:
        """Set rows to given values (inserting absent signs, bypassing admission) and mark them for
        the next delta: for rows computed elsewhere (imports, tools, tests). Returns rows written."""
        signs = as_signs(signs)
        rows = np.asarray(rows, dtype=np.float32)
        if rows.shape != (len(signs), self.config.dim) or not np.isfinite(rows).all():
            raise ValueError(f"rows must be finite float32 of shape ({len(signs)}, {self.config.dim})")
        if len(np.unique(signs)) != len(signs):
            raise ValueError("assign needs distinct signs")
        with self._lock:
            slots = index.find_slots(self._table, self._keys, signs, self._bits)
            absent = slots < 0
            if absent.any():
                self._insert(signs[absent], protect=slots[~absent])
                slots = index.find_slots(self._table, self._keys, signs, self._bits)
            ok = slots >= 0
            self._rows[slots[ok]] = rows[ok]
            self._dirty[slots[ok]] = True
            return int(ok.sum())

    def apply_gradients(self, signs, grads, step: int = 0) -> int:
        """Apply gradients (float32, (n, dim)) with the store's optimizer; duplicate signs are
        summed first; signs without a row (never admitted, or evicted) are skipped. ``step`` is
        the optimizer step for Adam (0: count locally). Returns the distinct signs updated."""
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
    def memory_bytes(self) -> int:
        """Bytes of every array the store holds (index, keys, rows, state, metadata, sketch)."""
        arrays = [
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
                "capacity": cfg.capacity,
                "memory_bytes": self.memory_bytes,
                "hits": self.hits,
                "misses": self.misses,
                "inserts": self.inserts,
                "evictions": self.evictions,
                "expired": self.expired,
                "optimizer": cfg.optimizer.name,
                "step": self.step,
                "version": self.version,
                "delta_seq": self.delta_seq,
            }

    def __len__(self) -> int:
        return self.rows

    def __contains__(self, sign) -> bool:
        s = as_signs([sign])
        return bool(index.find_slots(self._table, self._keys, s, self._bits)[0] >= 0)
