"""One PS shard of an embedding table (``TableShard``): a plain class, no network, and its collaborators.

Rows are kept dense in arrays allocated for ``capacity`` (positions 0..rows-1 occupied, so a dump is a
slice): the index of signs (``arrays.SignIndex``) and per row the values, optimizer state, stamp,
count and dirty flag (``arrays.RowArrays``), no per-ID Python objects. The shard owns the lock,
the row count, the version and the lookup counters; each collaborator owns its state:
``growth.Growth`` (memory limit, grows), ``admission.Admission`` (the sketch of unseen signs),
``eviction.Eviction`` (its counts) and ``persistence.ShardPersistence`` (snapshots, delta cuts,
the deletions since the last one, verified reads). Without an eviction policy a full shard
grows (amortised O(1) inserts) or raises ``CapacityError``, unchanged; with ``lru``/``lfu`` the
capacity is a bound.

All public methods take one lock, so a lookup sees a delta entirely or not at all, whether the
shard is called in-process from several threads or from the gRPC server's event loop.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from model_store import shards
from model_store.errors import CapacityError, StoreError
from model_store.meta import ShardMeta
from model_store.shards import ShardData
from serving.ps import optim
from serving.ps.admission import Admission
from serving.ps.arrays import RowArrays, SignIndex, checked_assign, checked_grads, coalesce
from serving.ps.config import TableShardConfig, as_signs, check_holds, is_next_delta
from serving.ps.eviction import Eviction
from serving.ps.growth import Growth
from serving.ps.optim import OptimizerSpec
from serving.ps.persistence import ShardPersistence

__all__ = ["CapacityError", "TableShard", "OptimizerSpec", "TableShardConfig", "StoreError"]


class TableShard:
    """Rows and optimizer state of one shard, addressed by uint64 sign."""

    def __init__(self, config: TableShardConfig, clock: Callable[[], float] = time.time):
        self.config = config
        self.clock = clock
        self._growth = Growth(config)
        self._growth.check(config.capacity)
        self._index = SignIndex.empty(config.capacity)
        self._arrays = RowArrays.allocate(config, config.capacity)
        self._admission = Admission(config.min_count, config.capacity) if config.min_count > 1 else None
        self._eviction = Eviction(config)
        self._persistence = ShardPersistence(config)
        self._lock = threading.RLock()
        self.rows = 0
        self.version = ""
        """Model-store version this shard serves ('' until loaded or set)."""
        self.delta_seq = -1
        """Sequence number of the last delta cut (training) or applied (serving); -1: none."""
        self.step = 0
        """Optimizer step count (Adam bias correction)."""
        self.hits = self.misses = self.inserts = 0

    @property
    def capacity(self) -> int:
        """Rows the arrays hold now (``config.capacity`` at first; growth raises it)."""
        return self._index.capacity

    @property
    def evictions(self) -> int:
        return self._eviction.evictions

    @property
    def expired(self) -> int:
        return self._eviction.expired

    @property
    def grows(self) -> int:
        return self._growth.grows

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
            if insert and self._arrays.values.dtype == np.float32:  # admit, touch and gather by position
                rows_at = self._admit(signs, touch=False)
                out, misses = self._arrays.touch_gather(rows_at, np.uint32(self.clock()))
                return out, misses, (self.version, self.delta_seq)
            if insert:
                self._admit(signs)
            out, misses = self._index.gather(self._arrays.values, signs)
            if not insert:
                self.hits += len(signs) - misses
                self.misses += misses
            return out, misses, (self.version, self.delta_seq)

    def _admit(self, signs: np.ndarray, touch: bool = True) -> np.ndarray:
        """Insert the unseen ``signs`` admission lets in; their positions (-1: not admitted). With
        ``touch`` the found rows' stamp and count are refreshed here (else by the caller)."""
        rows_at = self._index.find(signs)
        found = rows_at >= 0
        n_found = int(found.sum())
        self.hits += n_found
        self.misses += len(signs) - n_found
        hit_rows_at = rows_at[found]
        if n_found < len(signs):
            new, counts = np.unique(signs[~found], return_counts=True)
            if self._admission is not None:
                new = self._admission.admit(new, counts)
            if len(new):
                self._insert(new, protect=hit_rows_at)
                rows_at = self._index.find(signs)
                hit_rows_at = rows_at[rows_at >= 0]
        if touch:
            self._arrays.touch(hit_rows_at, np.uint32(self.clock()))
        return rows_at

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
        self._index.add(new, self.rows)
        self._arrays.fresh(self.rows, new, self.config, np.uint32(self.clock()))
        self.rows += len(new)
        self.inserts += len(new)

    def _grow(self, need: int, keep: int, double: bool = True) -> None:
        """``Growth.grow``: room for ``need`` rows keeping positions 0..keep-1 (CapacityError, the
        store unchanged, when it cannot be had)."""
        self._index, self._arrays = self._growth.grow(
            self._index, self._arrays, self._admission, need, keep, held=self.rows, double=double
        )

    # ---- eviction ------------------------------------------------------------------------
    def _evict(self, k: int, protect: np.ndarray) -> None:
        victims = self._eviction.victims(self._arrays, self.rows, k, protect)
        if len(victims):
            self._remove(victims)
            self._eviction.evicted(len(victims), self.capacity, self.rows)

    def expire(self, now: float | None = None) -> int:
        """Remove rows untouched for ``ttl_s`` seconds; returns how many."""
        if self.config.ttl_s <= 0:
            return 0
        with self._lock:
            victims = self._eviction.stale(self._arrays, self.rows, self.clock() if now is None else now)
            if len(victims):
                self._remove(victims)
                self._eviction.expired += len(victims)
            return len(victims)

    def _remove(self, victims: np.ndarray) -> None:
        """Delete the rows at sorted distinct positions, record their signs for the next delta and
        refill the holes from the tail so rows stay dense."""
        self._persistence.deleted.append(self._index.keys[victims].copy())
        src, dst = self._index.remove(victims.astype(np.int64), self.rows)
        self._arrays.move(src, dst)
        self.rows -= len(victims)

    # ---- training ------------------------------------------------------------------------
    def assign(self, signs, rows, state: dict[str, np.ndarray] | None = None) -> int:
        """Set rows to given values (inserting absent signs, bypassing admission) and mark them for
        the next delta: for rows computed elsewhere (a trainer's replicated tables, imports,
        tests). ``state``: their optimizer state by name (this store's optimizer's; None: left as
        it is, a new row's initial). Returns rows written."""
        signs, rows, state = checked_assign(signs, rows, state, self.config)
        with self._lock:
            rows_at = self._index.find(signs)
            absent = rows_at < 0
            if absent.any():
                self._insert(signs[absent], protect=rows_at[~absent])
                rows_at = self._index.find(signs)
            ok = rows_at >= 0
            self._arrays.assign(rows_at[ok], rows[ok], {name: values[ok] for name, values in state.items()})
            return int(ok.sum())

    def apply_gradients(self, signs, grads, step: int = 0, distinct: bool = False) -> int:
        """Apply gradients (float32, (n, dim)) with the store's optimizer; duplicate signs are
        summed first (``distinct``: the caller knows there are none); signs without a row (never
        admitted, or evicted) are skipped. ``step`` is the optimizer step for Adam (0: count
        locally). Returns the distinct signs updated."""
        signs, grads = checked_grads(signs, grads, self.config.dim)
        if not len(signs):
            return 0
        cfg = self.config.optimizer
        opt = optim.get(cfg.name)
        kernel = opt.kernel() if distinct and self._arrays.values.dtype == np.float32 else None
        if kernel is not None:
            with self._lock:  # find + update in one compiled pass (the optimizer's fast path)
                self.step = step if step else self.step + 1
                ix, arrays = self._index, self._arrays
                return int(kernel(
                    ix.table, ix.keys, ix.bits, arrays.values, tuple(arrays.state[n] for n in opt.state),
                    signs, np.ascontiguousarray(grads), np.array(opt.hyper(cfg, self.step), np.float64),
                    arrays.stamp, np.uint32(self.clock()), arrays.dirty,
                ))  # fmt: skip
        uniq, summed = coalesce(signs, grads)
        with self._lock:
            self.step = step if step else self.step + 1
            rows_at = self._index.find(uniq)
            ok = rows_at >= 0
            self._arrays.update(rows_at[ok], summed[ok], cfg, self.step, np.uint32(self.clock()))
            return int(ok.sum())

    # ---- persistence (``ShardPersistence``; files: ``model_store.shards``) -------------------
    def _meta(self, kind: str, base_version: str = "") -> ShardMeta:
        return self._persistence.meta(kind, self.version, self.delta_seq, self.step, base_version)

    def snapshot(self, copy: bool = True) -> ShardData:
        """The shard's rows as ShardData (copies unless ``copy=False``: then views that later
        updates change, only safe while nothing changes the store -- the caller holds
        ``self._lock``, or, in the PS server, every change waits until the dump is written)."""
        with self._lock:
            return self._persistence.snapshot(self._index, self._arrays, self.rows, self._meta("full"), copy)

    def dump(self, directory) -> Path:
        """Write a full dump as ``directory/shard-<i>-of-<n>/``; returns its path."""
        with self._lock:  # writes from views: no copy, lookups wait until it is written
            return shards.write_shard(directory, self.snapshot(copy=False))

    def cut_delta(self) -> ShardData:
        """Take the rows changed and signs deleted since the last cut (a new delta seq), and
        reset the dirty tracking. ``restore_delta`` undoes a cut whose write failed."""
        with self._lock:
            self.delta_seq += 1
            meta = self._meta("delta", base_version=self.version)
            return self._persistence.cut(self._index, self._arrays, self.rows, meta)

    def restore_delta(self, data: ShardData) -> None:
        """Mark a cut delta's rows and deletions pending again (its write failed)."""
        with self._lock:
            self._persistence.restore(self._index, self._arrays, data)
            if self.delta_seq == data.meta.delta_seq:
                self.delta_seq -= 1

    def dump_delta(self, directory) -> Path:
        """Write the rows changed and signs deleted since the last cut as
        ``directory/shard-<i>-of-<n>/`` (meta ``delta_seq`` = the new seq); returns its path."""
        data = self.cut_delta()
        try:
            return shards.write_shard(directory, data)
        except BaseException:
            self.restore_delta(data)
            raise

    def read(self, paths, delta: bool = False) -> ShardData:
        """``ShardPersistence.read``: this shard's part of a dump or delta, verified; touches no
        store state (the server runs it off the loop)."""
        return self._persistence.read(paths, delta)

    def load(self, paths, shard: int | None = None, num_shards: int | None = None) -> int:
        """Replace the contents with a full dump: a shard directory, a directory of
        ``shard-*-of-*`` directories, or a list of shard directories. ``shard``/``num_shards``
        (default: the config's) pick this shard's rows by the routing hash. Returns rows."""
        if shard is not None or num_shards is not None:
            with self._lock:
                self.config.num_shards = num_shards if num_shards is not None else self.config.num_shards
                self.config.shard = shard if shard is not None else self.config.shard
        return self.install(self.read(paths))

    # the Follower's protocol (serving/ps/follow.py: FollowedShard), shared with MappedTableShard
    flip_bytes = 0
    """Deltas apply in place, each as it is read."""

    def apply_deltas_data(self, deltas: list[ShardData]) -> int:
        """Apply ``deltas`` in seq order (each under the lock); returns the rows written."""
        return sum(self.apply_delta_data(d) for d in deltas)

    def staging(self) -> TableShard:
        """An empty store of the same configuration, to build the next version in."""
        return type(self)(dataclasses.replace(self.config))

    def open(self, paths, version: str | None = None) -> int:
        """Replace the contents with a full dump (``load``), named ``version`` if given."""
        n = self.install(self.read(paths))
        if version is not None:
            self.version = version
        return n

    def adopt(self, other: TableShard) -> int:
        """Take over what ``other`` (a staging store) holds, in one step under the lock."""
        return self.install(other.snapshot(copy=False))

    def install(self, data: ShardData) -> int:
        """Replace the contents with a full dump already read (``read``). A dump with more rows
        than the capacity gets room for all of them (``CapacityError`` past the memory limit, the
        contents unchanged): a version is never refused for the configured capacity, nor cut."""
        n = len(data.signs)
        with self._lock:
            if n > self.capacity:
                self._grow(n, keep=0, double=False)
            self._index.fill(data.signs)  # read() refuses dumps with duplicate signs
            self._arrays.fill(n, data, self.config.optimizer)
            self._persistence.deleted = []
            self.rows = n
            if not self.config.schema_hash:
                self.config.schema_hash = data.meta.schema_hash
            self.version = data.meta.version
            self.delta_seq = data.meta.delta_seq
            self.step = data.meta.step
            return n

    def apply_delta(self, paths) -> int:
        """Apply a delta directory (deletions, then row values); returns rows written. A delta
        whose seq was already applied is skipped; a gap in the sequence is refused."""
        return self.apply_delta_data(self.read(paths, delta=True))

    def apply_delta_data(self, data: ShardData) -> int:
        with self._lock:
            if not is_next_delta(data.meta, self.version, self.delta_seq):
                return 0
            if self.config.eviction == "none":  # room first: a delta past the limit changes nothing
                new = int((self._index.find(data.signs) < 0).sum())
                if self.rows + new > self.capacity:
                    self._grow(self.rows + new, keep=self.rows)
            if len(data.deleted):
                rows_at = self._index.find(data.deleted)
                rows_at = np.sort(rows_at[rows_at >= 0])
                if len(rows_at):
                    self._remove(rows_at)
                    self._persistence.deleted.pop()  # applied deletions are not ours to publish again
            rows_at = self._index.find(data.signs)
            absent = rows_at < 0
            if absent.any():
                self._insert(data.signs[absent], protect=rows_at[~absent])
                rows_at = self._index.find(data.signs)
            ok = rows_at >= 0
            rows_at = rows_at[ok]
            self._arrays.put(rows_at, data, ok, self.config.optimizer)
            self.delta_seq = data.meta.delta_seq
            self.step = max(self.step, data.meta.step)
            return len(rows_at)

    # ---- introspection -------------------------------------------------------------------
    def bytes_for(self, cap: int) -> int:
        """``memory_bytes`` of this store at capacity ``cap``."""
        return self._growth.bytes_for(cap)

    @property
    def memory_bytes(self) -> int:
        """Bytes of every array the store holds (index, keys, rows, state, metadata, sketch)."""
        sketch = self._admission.nbytes if self._admission is not None else 0
        return self._index.nbytes + self._arrays.nbytes + sketch

    @property
    def raw_bytes_per_row(self) -> int:
        """8-byte key + row + optimizer state: the floor any layout must pay per row."""
        cfg = self.config
        return 8 + cfg.dim * (np.dtype(cfg.dtype).itemsize + 4 * len(self._arrays.state))

    def stats(self) -> dict:
        with self._lock:
            cfg = self.config
            mine = (
                "rows",
                "capacity",
                "memory_bytes",
                "hits",
                "misses",
                "inserts",
                "evictions",
                "expired",
                "grows",
            )
            return {
                "shard": cfg.shard, "num_shards": cfg.num_shards, "dim": cfg.dim, "dtype": cfg.dtype,
                **{name: getattr(self, name) for name in mine},
                "eviction": cfg.eviction, "optimizer": cfg.optimizer.name, "step": self.step,
                "version": self.version, "delta_seq": self.delta_seq,
            }  # fmt: skip

    def __len__(self) -> int:
        return self.rows

    def __contains__(self, sign) -> bool:
        s = as_signs([sign])
        with self._lock:
            return bool(self._index.find(s)[0] >= 0)
