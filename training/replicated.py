"""The sharding plan's ``replicated`` tables: rows inside the trainer, updated synchronously.

One in-process ``TableShard`` -- the PS shard's own class, so the same per-sign initial row,
the same sparse optimizer and state, the same growth -- holds the rows of every slot the plan
replicates. A training lookup inserts unseen signs; an update is applied before the next step
(no staleness). Under torchrun every rank holds a copy: each step, every rank's per-sign gradients
are all-gathered and applied on every rank (signs another rank inserted are inserted first, with
the same deterministic initial row), so the copies stay equal.

The plan never changes what is exported: before every dump of the PS shards (delta, checkpoint,
version) the rows changed since the last dump (``push``) are written into the shards that own them
with their optimizer state (``Cluster.dump``, the PS's Assign RPC). The shards then hold every
table, and serving never knows how a version was trained.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from model_store.shards import ShardData
from serving.ps.shard import TableShard

if TYPE_CHECKING:
    from serving.ps.config import TableShardConfig


class Replicated:
    """The replicated tables of one rank."""

    def __init__(self, store: TableShardConfig, capacity: int, world: int = 1, max_memory_gb: float = 0.0):
        """``store``: the shards' config (the table spec); ``capacity``: the rows expected (the
        plan's estimate); ``max_memory_gb``: the plan's budget per rank (0: none), past which
        training stops loudly rather than outgrow it."""
        from serving.ps.growth import GIB, store_bytes

        cfg = dataclasses.replace(store, shard=0, num_shards=1).with_table(
            max_memory_gb=max_memory_gb, eviction="none", ttl_s=0.0
        )
        cap = max(1024, int(capacity * 1.25))  # a quarter to spare before the first growth
        if max_memory_gb and store_bytes(cfg, cap) > max_memory_gb * GIB:
            cap = max(1024, capacity)
        self.store = TableShard(cfg.with_table(capacity=cap))
        self.world = world

    def rows(self, signs: np.ndarray, train: bool) -> np.ndarray:
        """float32 (n, dim) rows of distinct ``signs``; ``train`` inserts unseen ones."""
        return self.store.rows_of(signs, train)[0]

    def update(self, signs: np.ndarray, grads: np.ndarray) -> None:
        """Apply this step's per-sign gradients (every rank's, under torchrun) now."""
        if self.world == 1:
            self.store.apply_gradients(signs, grads, distinct=True)
            return
        import torch.distributed as dist

        # all_gather_object fills a list[Any] (torch's type) with each rank's object: here its pair
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, (signs, grads))
        signs = np.concatenate([s for s, _ in every])
        grads = np.concatenate([g for _, g in every])
        self.store.rows_of(np.unique(signs), True)  # rows other ranks inserted: the same init
        self.store.apply_gradients(signs, grads)  # the ranks' gradients of one sign summed

    def digest(self) -> str:
        """A hash of every row and its optimizer state, by sign (the order rows were inserted in,
        and their last-access stamps, differ between ranks; the rows must not)."""
        import xxhash

        data = self.store.snapshot(copy=False)
        order = np.argsort(data.signs, kind="stable")
        h = xxhash.xxh3_64()
        for a in (data.signs, data.rows, *(data.state[k] for k in sorted(data.state))):
            h.update(np.ascontiguousarray(a[order]).tobytes())
        return f"{len(order)}:{h.hexdigest()}"

    def check_equal(self) -> str:
        """Every rank's copy is the same (``digest`` all-gathered): a RuntimeError naming the
        ranks that differ otherwise, never a silent divergence. Returns the digest."""
        mine = self.digest()
        if self.world == 1:
            return mine
        import torch.distributed as dist

        every: list[Any] = [None] * self.world  # each rank's digest (all_gather_object: list[Any])
        dist.all_gather_object(every, mine)
        if len(set(every)) > 1:
            raise RuntimeError(
                "the replicated tables differ between ranks (rows:digest per rank): " + ", ".join(every)
            )
        return mine

    def push(self) -> ShardData:
        """The rows changed since the last push, with their optimizer state, for the cluster to
        write into the PS shards that own them (``Cluster.dump``); ``restore`` them if it cannot."""
        return self.store.cut_delta()

    def restore(self, data: ShardData) -> None:
        """Rows ``push`` gave that did not reach the shards: changed again, for the next push."""
        self.store.restore_delta(data)

    def load(self, directory: str | Path, local: np.ndarray) -> int:
        """Take the rows of the replicated slots (``local``: bool per slot id) from a full dump
        of the shards (a checkpoint's); returns the rows loaded."""
        from features.hashing import SLOT_SHIFT

        data = self.store.read(directory)
        slot = (data.signs >> np.uint64(SLOT_SHIFT)).astype(np.int64)
        keep = np.zeros(len(data.signs), bool)
        ok = slot < len(local)
        keep[ok] = local[slot[ok]]
        mine = ShardData(
            meta=data.meta,
            signs=data.signs[keep],
            rows=data.rows[keep],
            state={k: v[keep] for k, v in data.state.items()},
            stamp=data.stamp[keep],
            count=data.count[keep],
        )
        return self.store.install(mine)

    def __len__(self) -> int:
        return len(self.store)
