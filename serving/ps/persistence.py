"""A training shard's contents as ``ShardData`` (snapshots, delta cuts) and back from files
(verified reads): the persistence collaborator of ``TableShard``, which passes it the index
and arrays it holds, under the store's lock. The file format itself is ``model_store.shards``."""

from __future__ import annotations

import time

import numpy as np
from numpy.typing import NDArray

from features.hashing import has_duplicates, unique_signs
from model_store import shards
from model_store.errors import StoreError
from model_store.meta import ShardMeta
from model_store.shards import ShardData
from serving.ps.arrays import RowArrays, SignIndex
from serving.ps.config import TableShardConfig

__all__ = ["ShardPersistence"]


class ShardPersistence:
    """Snapshots, delta cuts and verified reads of one shard. Owns what a delta needs beyond the
    rows marked dirty: the signs deleted since the last cut (``deleted``)."""

    def __init__(self, config: TableShardConfig):
        self.config = config
        self.deleted: list[NDArray[np.uint64]] = []

    def meta(self, kind: str, version: str, delta_seq: int, step: int, base_version: str = "") -> ShardMeta:
        cfg = self.config
        return ShardMeta(
            kind=kind, shard=cfg.shard, num_shards=cfg.num_shards, table=cfg.table.to_json(),
            state=list(cfg.optimizer.state_names), schema_hash=cfg.schema_hash, version=version,
            delta_seq=delta_seq, base_version=base_version, step=step, seed=cfg.seed, created=time.time(),
        )  # fmt: skip

    def snapshot(self, signs: SignIndex, arrays: RowArrays, n: int, meta: ShardMeta, copy: bool) -> ShardData:
        """The first ``n`` rows as ShardData (copies unless ``copy=False``: then views that later
        updates change)."""
        c = np.copy if copy else (lambda a: a)
        return ShardData(
            meta=meta,
            signs=c(signs.keys[:n]),
            rows=c(arrays.values[:n]),
            state={k: c(v[:n]) for k, v in arrays.state.items()},
            stamp=c(arrays.stamp[:n]),
            count=c(arrays.count[:n]),
        )

    def cut(self, signs: SignIndex, arrays: RowArrays, n: int, meta: ShardMeta) -> ShardData:
        """The rows changed (dirty) and signs deleted since the last cut, as a delta of ``meta``;
        the dirty marks and the deletions are reset (``restore`` undoes it)."""
        rows_at = np.flatnonzero(arrays.dirty[:n])
        deleted = unique_signs(np.concatenate([np.empty(0, np.uint64), *self.deleted]))
        if len(deleted):  # deleted, then inserted again: the row wins
            deleted = deleted[signs.find(deleted) < 0]
        data = ShardData(
            meta=meta,
            signs=signs.keys[rows_at],
            rows=arrays.values[rows_at],
            state={k: v[rows_at] for k, v in arrays.state.items()},
            stamp=arrays.stamp[rows_at],
            count=arrays.count[rows_at],
            deleted=deleted,
        )
        arrays.dirty[:n] = False
        self.deleted = []
        return data

    def restore(self, signs: SignIndex, arrays: RowArrays, data: ShardData) -> None:
        """Mark a cut delta's rows and deletions pending again (its write failed)."""
        rows_at = signs.find(data.signs)
        arrays.dirty[rows_at[rows_at >= 0]] = True
        self.deleted.append(data.deleted)

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
        return data.decoded(self.config.dtype)  # a version in a serving dtype: the rows it serves
