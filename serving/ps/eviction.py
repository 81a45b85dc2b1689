"""Which rows a bounded training shard drops: the eviction policy (``TableShardConfig.eviction``
lru/lfu, when full) and the TTL (``ttl_s``), with their counts and a rate-limited log line."""

from __future__ import annotations

import logging
import time

import numpy as np

from features.hashing import unique_signs
from serving.ps.arrays import RowArrays
from serving.ps.config import TableShardConfig

__all__ = ["Eviction", "LOG_EVERY_S"]

log = logging.getLogger("recserve.ps.store")

LOG_EVERY_S = 10.0  # eviction log lines: at most one per this many seconds, with running totals


class Eviction:
    """Chooses victims and counts them (``evictions``: by the policy, ``expired``: by the TTL)."""

    def __init__(self, config: TableShardConfig):
        self.config = config
        self.evictions = 0
        self.expired = 0
        self._logged = (-np.inf, 0)  # (monotonic time, evictions) of the last log line

    def victims(self, arrays: RowArrays, n: int, k: int, protect: np.ndarray) -> np.ndarray:
        """Sorted positions of the ``k`` rows among the first ``n`` the policy drops first, never one
        in ``protect`` (fewer when too many are protected)."""
        stamp = arrays.stamp[:n].astype(np.uint64)
        count = arrays.count[:n].astype(np.uint64)
        if self.config.eviction == "lru":
            key = (stamp << np.uint64(32)) | count
        else:
            key = (count << np.uint64(32)) | stamp
        key[protect] = np.iinfo(np.uint64).max
        k = min(k, n - len(unique_signs(protect)))
        if k <= 0:
            return np.empty(0, np.int64)
        return np.sort(np.argpartition(key, k - 1)[:k] if k < n else np.arange(n))

    def stale(self, arrays: RowArrays, n: int, now: float) -> np.ndarray:
        """Slots among the first ``n`` untouched for ``ttl_s`` seconds at ``now``."""
        return np.flatnonzero(arrays.stamp[:n] < now - self.config.ttl_s)

    def evicted(self, k: int, capacity: int, held: int) -> None:
        """Count ``k`` rows evicted; log the running totals at most every LOG_EVERY_S."""
        self.evictions += k
        now, (last, before) = time.monotonic(), self._logged
        if now - last >= LOG_EVERY_S:
            cfg = self.config
            self._logged = (now, self.evictions)
            log.info(
                "shard %d: %d rows evicted (%s at capacity %d), %d since the last report, %d held",
                cfg.shard, self.evictions, cfg.eviction, capacity, self.evictions - before, held,
            )  # fmt: skip
