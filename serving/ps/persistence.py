"""The store's state in and out: snapshots, full dumps and deltas (cut, dump, restore), verified
reads and installs, delta application. A mixin of ``EmbeddingStore`` (which owns the arrays,
the index and the lock); the file format itself is ``model_store.shards``."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from features.hashing import has_duplicates, unique_signs
from model_store import shards
from model_store.shards import ShardData, ShardMeta, StoreError
from serving.ps import index
from serving.ps.fields import StoreFields

__all__ = ["ShardPersistence"]


class ShardPersistence(StoreFields):
    """Dump/load/delta methods of ``EmbeddingStore``."""

    def _meta(self, kind: str, base_version: str = "") -> ShardMeta:
        cfg = self.config
        return ShardMeta(
            kind=kind, shard=cfg.shard, num_shards=cfg.num_shards, table=cfg.table.to_json(),
            state=list(cfg.optimizer.state_names), schema_hash=cfg.schema_hash, version=self.version,
            delta_seq=self.delta_seq, base_version=base_version, step=self.step, seed=cfg.seed,
            created=time.time(),
        )  # fmt: skip

    def snapshot(self, copy: bool = True) -> ShardData:
        """The shard's rows as ShardData (copies unless ``copy=False``: then views that later
        updates change, only safe while nothing changes the store -- the caller holds
        ``self._lock``, or, in the PS server, every change waits until the dump is written)."""
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
            return shards.write_shard(directory, self.snapshot(copy=False))

    def cut_delta(self) -> ShardData:
        """Take the rows changed and signs deleted since the last cut (a new delta seq), and
        reset the dirty tracking. ``restore_delta`` undoes a cut whose write failed."""
        with self._lock:
            slots = np.flatnonzero(self._dirty[: self.rows])
            signs = self._keys[slots]
            deleted = unique_signs(np.concatenate([np.empty(0, np.uint64), *self._deleted]))
            if len(deleted):  # deleted, then inserted again: the row wins
                deleted = deleted[index.find_slots(self._table, self._keys, deleted, self._bits) < 0]
            self.delta_seq += 1
            data = ShardData(
                meta=self._meta("delta", base_version=self.version),
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

    def _check(self, meta: ShardMeta, where: str) -> None:
        cfg = self.config
        shards.check_compatible(meta, cfg.dim, cfg.dtype, cfg.schema_hash, where)

    def read(self, paths, delta: bool = False) -> ShardData:
        """Read and verify the part of a dump (or delta) this shard owns, re-sharding if the dump
        has another shard count. Touches no store state (the server runs it off the loop)."""
        data = shards.read_for_shard(paths, self.config.shard, self.config.num_shards, check=self._check)
        kind = data.meta.kind
        if kind != ("delta" if delta else "full"):
            raise StoreError(f"{paths}: is a {kind} dump, expected a {'delta' if delta else 'full'} one")
        if has_duplicates(data.signs):
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

    # the Follower's protocol (serving/ps/follow.py), shared with MappedStore
    def staging(self):
        """An empty store of the same configuration, to build the next version in."""
        import dataclasses

        return type(self)(dataclasses.replace(self.config))

    def open(self, paths, version: str | None = None) -> int:
        """Replace the contents with a full dump (``load``), named ``version`` if given."""
        n = self.install(self.read(paths))
        if version is not None:
            self.version = version
        return n

    def adopt(self, other) -> int:
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
            self._keys[:n] = data.signs
            dups = index.rebuild(self._table, self._keys, n, self._bits)
            assert dups == 0, "read() refuses dumps with duplicate signs"
            self._rows[:n] = data.rows
            same_optimizer = data.meta.optimizer == self.config.optimizer.name
            for name, arr in self._state.items():
                arr[:n] = data.state[name] if same_optimizer else self.config.optimizer.initial_state(name)
            self._stamp[:n] = data.stamp
            self._count[:n] = data.count
            self._dirty[:] = False
            self._deleted = []
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
        seq, base = data.meta.delta_seq, data.meta.base_version
        with self._lock:
            if base and self.version and base != self.version:
                raise StoreError(
                    f"delta {seq} belongs to version {base!r}, this shard serves {self.version!r}"
                )
            if seq <= self.delta_seq:
                return 0
            if seq != self.delta_seq + 1:
                raise StoreError(f"delta {seq} does not follow the last applied delta {self.delta_seq}")
            if self.config.eviction == "none":  # room first: a delta past the limit changes nothing
                new = int((index.find_slots(self._table, self._keys, data.signs, self._bits) < 0).sum())
                if self.rows + new > self.capacity:
                    self._grow(self.rows + new, keep=self.rows)
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
            if data.meta.optimizer == self.config.optimizer.name:
                for name, arr in self._state.items():
                    arr[slots] = data.state[name][ok]
            self._stamp[slots] = data.stamp[ok]
            self._count[slots] = data.count[ok]
            self._dirty[slots] = False
            self.delta_seq = seq
            self.step = max(self.step, data.meta.step)
            return len(slots)
