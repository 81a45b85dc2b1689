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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from serving.ps import index, optim, persist
from serving.ps.optim import OptimizerConfig
from serving.ps.persist import ShardData, StoreError

__all__ = ["EmbeddingStore", "OptimizerConfig", "StoreConfig", "StoreError"]

_DTYPES = ("float32", "float16")


@dataclass
class StoreConfig:
    """Configuration of one PS shard's store."""

    dim: int = 16
    """Embedding dimension (all slots of a shard share it)."""
    capacity: int = 1_000_000
    """Maximum rows; memory for them is allocated up front. Inserting beyond evicts."""
    dtype: str = "float32"
    """Row storage type: float32, or float16 to halve row memory (state stays float32)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Sparse optimizer applied by ``apply_gradients``."""
    init_scale: float = 0.01
    """New rows are uniform(-init_scale, init_scale), drawn deterministically from the sign."""
    seed: int = 0
    """Salt of the deterministic initialisation (same seed + sign = same row everywhere)."""
    min_count: int = 1
    """Admission: a sign gets a row only once it has been seen this many times (count-min
    sketch); until then lookups answer the default (zero) row."""
    eviction: str = "lru"
    """Which rows go when the store is full: lru (least recently touched) or lfu (least often)."""
    evict_fraction: float = 0.01
    """When full, evict at least this fraction of capacity at once (amortises the scan)."""
    ttl_s: float = 0.0
    """Rows untouched for this long are expired by ``expire()`` (0 = never)."""
    schema_hash: str = ""
    """Feature-schema hash written into dumps and required of loaded dumps ('' = not checked)."""
    shard: int = 0
    """This shard's number (names the dump directory, filters re-sharded loads)."""
    num_shards: int = 1
    """Number of shards the signs are routed over by ``features.hashing.shard_of``."""

    def __post_init__(self) -> None:
        if isinstance(self.optimizer, dict):
            self.optimizer = OptimizerConfig(**self.optimizer)
        if self.dim < 1 or self.capacity < 1:
            raise ValueError(f"dim and capacity must be >= 1 (dim={self.dim}, capacity={self.capacity})")
        if self.capacity >= 2**31 - 1:
            raise ValueError("capacity must be < 2**31 - 1 per shard (int32 slots); add shards")
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose float32 or float16")
        if self.eviction not in ("lru", "lfu"):
            raise ValueError(f"unknown eviction policy {self.eviction!r}; choose lru or lfu")
        if not 0 <= self.shard < self.num_shards:
            raise ValueError(f"shard {self.shard} outside 0..{self.num_shards - 1}")
        if self.min_count < 1:
            raise ValueError("min_count must be >= 1")

    @classmethod
    def from_dict(cls, d: dict) -> StoreConfig:
        return cls(**d)


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


class EmbeddingStore:
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
    def _meta(self, kind: str) -> dict:
        cfg = self.config
        return {
            "kind": kind,
            "shard": cfg.shard,
            "num_shards": cfg.num_shards,
            "dim": cfg.dim,
            "dtype": cfg.dtype,
            "optimizer": asdict(cfg.optimizer),
            "state": list(cfg.optimizer.state_names),
            "schema_hash": cfg.schema_hash,
            "version": self.version,
            "delta_seq": self.delta_seq,
            "step": self.step,
            "seed": cfg.seed,
            "init_scale": cfg.init_scale,
            "created": time.time(),
        }

    def snapshot(self, copy: bool = True) -> ShardData:
        """The shard's rows as ShardData (copies unless ``copy=False``: then views that later
        updates change, only safe while the caller holds ``self._lock``)."""
        with self._lock:
            n = self.rows
            c = np.copy if copy else (lambda a: a)
            return ShardData(
                meta=self._meta("full"),
                signs=c(self._keys[:n]),
                rows=c(self._rows[:n]),
                state={k: c(v[:n]) for k, v in self._state.items()},
                stamp=c(self._stamp[:n]),
                count=c(self._count[:n]),
            )

    def dump(self, directory) -> Path:
        """Write a full dump as ``directory/shard-<i>-of-<n>/``; returns its path."""
        with self._lock:  # writes from views: no copy, lookups wait until it is written
            return persist.write_shard(directory, self.snapshot(copy=False))

    def cut_delta(self) -> ShardData:
        """Take the rows changed and signs deleted since the last cut (a new delta seq), and
        reset the dirty tracking. ``restore_delta`` undoes a cut whose write failed."""
        with self._lock:
            slots = np.flatnonzero(self._dirty[: self.rows])
            signs = self._keys[slots]
            deleted = np.unique(np.concatenate([np.empty(0, np.uint64), *self._deleted]))
            if len(deleted):  # deleted, then inserted again: the row wins
                deleted = deleted[index.find_slots(self._table, self._keys, deleted, self._bits) < 0]
            self.delta_seq += 1
            data = ShardData(
                meta=self._meta("delta") | {"base_version": self.version},
                signs=signs,
                rows=self._rows[slots],
                state={k: v[slots] for k, v in self._state.items()},
                stamp=self._stamp[slots],
                count=self._count[slots],
                deleted=deleted,
            )
            self._dirty[: self.rows] = False
            self._deleted = []
            return data

    def restore_delta(self, data: ShardData) -> None:
        """Mark a cut delta's rows and deletions pending again (its write failed)."""
        with self._lock:
            slots = index.find_slots(self._table, self._keys, data.signs, self._bits)
            self._dirty[slots[slots >= 0]] = True
            self._deleted.append(data.deleted)
            if self.delta_seq == data.meta["delta_seq"]:
                self.delta_seq -= 1

    def dump_delta(self, directory) -> Path:
        """Write the rows changed and signs deleted since the last cut as
        ``directory/shard-<i>-of-<n>/`` (meta ``delta_seq`` = the new seq); returns its path."""
        data = self.cut_delta()
        try:
            return persist.write_shard(directory, data)
        except BaseException:
            self.restore_delta(data)
            raise

    def _check(self, meta: dict, where: str) -> None:
        cfg = self.config
        persist.check_compatible(meta, cfg.dim, cfg.dtype, cfg.schema_hash, where)

    def read(self, paths, delta: bool = False) -> ShardData:
        """Read and verify the part of a dump (or delta) this shard owns, re-sharding if the dump
        has another shard count. Touches no store state (the server runs it off the loop)."""
        data = persist.read_for_shard(paths, self.config.shard, self.config.num_shards, check=self._check)
        kind = data.meta.get("kind")
        if kind != ("delta" if delta else "full"):
            raise StoreError(f"{paths}: is a {kind} dump, expected a {'delta' if delta else 'full'} one")
        if len(np.unique(data.signs)) != len(data.signs):
            raise StoreError(f"{paths}: the dump holds duplicate signs; refusing it")
        return data

    def load(self, paths, shard: int | None = None, num_shards: int | None = None) -> int:
        """Replace the contents with a full dump: a shard directory, a directory of
        ``shard-*-of-*`` directories, or a list of shard directories. ``shard``/``num_shards``
        (default: the config's) pick this shard's rows by the routing hash. Returns rows."""
        if shard is not None or num_shards is not None:
            with self._lock:
                self.config.num_shards = num_shards if num_shards is not None else self.config.num_shards
                self.config.shard = shard if shard is not None else self.config.shard
        return self.install(self.read(paths))

    def install(self, data: ShardData) -> int:
        """Replace the contents with a full dump already read (``read``)."""
        n = len(data.signs)
        if n > self.config.capacity:
            raise StoreError(
                f"dump has {n} rows for this shard, more than the capacity {self.config.capacity}"
            )
        with self._lock:
            self._keys[:n] = data.signs
            dups = index.rebuild(self._table, self._keys, n, self._bits)
            assert dups == 0, "read() refuses dumps with duplicate signs"
            self._rows[:n] = data.rows
            same_optimizer = data.meta["optimizer"]["name"] == self.config.optimizer.name
            for name, arr in self._state.items():
                arr[:n] = data.state[name] if same_optimizer else self.config.optimizer.initial_state(name)
            self._stamp[:n] = data.stamp
            self._count[:n] = data.count
            self._dirty[:] = False
            self._deleted = []
            self.rows = n
            if not self.config.schema_hash:
                self.config.schema_hash = data.meta.get("schema_hash", "")
            self.version = data.meta.get("version", "")
            self.delta_seq = int(data.meta.get("delta_seq", -1))
            self.step = int(data.meta.get("step", 0))
            return n

    def apply_delta(self, paths) -> int:
        """Apply a delta directory (deletions, then row values); returns rows written. A delta
        whose seq was already applied is skipped; a gap in the sequence is refused."""
        return self.apply_delta_data(self.read(paths, delta=True))

    def apply_delta_data(self, data: ShardData) -> int:
        seq = int(data.meta["delta_seq"])
        base = data.meta.get("base_version", "")
        with self._lock:
            if base and self.version and base != self.version:
                raise StoreError(
                    f"delta {seq} belongs to version {base!r}, this shard serves {self.version!r}"
                )
            if seq <= self.delta_seq:
                return 0
            if seq != self.delta_seq + 1:
                raise StoreError(f"delta {seq} does not follow the last applied delta {self.delta_seq}")
            if len(data.deleted):
                slots = index.find_slots(self._table, self._keys, data.deleted, self._bits)
                slots = np.sort(slots[slots >= 0])
                if len(slots):
                    self._remove(slots)
                    self._deleted.pop()  # applied deletions are not ours to publish again
            slots = index.find_slots(self._table, self._keys, data.signs, self._bits)
            absent = slots < 0
            if absent.any():
                self._insert(data.signs[absent], protect=slots[~absent])
                slots = index.find_slots(self._table, self._keys, data.signs, self._bits)
            ok = slots >= 0
            slots = slots[ok]
            self._rows[slots] = data.rows[ok]
            if data.meta["optimizer"]["name"] == self.config.optimizer.name:
                for name, arr in self._state.items():
                    arr[slots] = data.state[name][ok]
            self._stamp[slots] = data.stamp[ok]
            self._count[slots] = data.count[ok]
            self._dirty[slots] = False
            self.delta_seq = seq
            self.step = max(self.step, int(data.meta.get("step", 0)))
            return len(slots)

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
