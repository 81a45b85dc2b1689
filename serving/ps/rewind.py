"""Rewinding a training shard's rows to what an earlier delta of its version held (the streaming
trainer's output guard, ``training.follow.revert``): the changes not yet cut are dropped, and each
row changed since that delta gets its value and optimizer state back, or is deleted if the version
had none then. The rewound rows and deletions are pending for the next delta like any change, so
serving applies the rewind as a delta (no response mixes versions; every host follows)."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from features.hashing import unique_signs
from model_store.shards import ShardData
from serving.ps.shard import TableShard


def drop_pending(store: TableShard) -> NDArray[np.uint64]:
    """Forget the changes since the last cut (nothing of them is published); the signs they
    touched (changed or deleted)."""
    with store._lock:
        seq = store.delta_seq
        data = store.cut_delta()
        store.delta_seq = seq  # no delta was written: the next one keeps its number
    return unique_signs(np.concatenate([data.signs, data.deleted]))


def rewind(store: TableShard, good: ShardData, signs: NDArray[np.uint64]) -> tuple[int, int]:
    """Give each of ``signs`` the row ``good`` (this shard's contents at the earlier delta)
    holds, or delete it where ``good`` has none; (rows written back, rows deleted)."""
    signs = unique_signs(signs)
    order = np.argsort(good.signs, kind="stable")
    at = np.searchsorted(good.signs, signs, sorter=order)
    at = np.minimum(at, max(len(order) - 1, 0))
    src = order[at] if len(order) else np.zeros(0, np.intp)
    had = (good.signs[src] == signs) if len(order) else np.zeros(len(signs), bool)
    back, gone = signs[had], signs[~had]
    state = {k: v[src[had]] for k, v in good.state.items()}
    written = store.assign(back, good.rows[src[had]].astype(np.float32), state) if len(back) else 0
    with store._lock:
        rows_at = store._index.find(gone)
        rows_at = np.sort(rows_at[rows_at >= 0])
        if len(rows_at):
            store._remove(rows_at)
    return written, len(rows_at)
