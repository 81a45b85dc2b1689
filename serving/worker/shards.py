"""The worker's view of the PS shards: one backend per shard, and the router that splits signs.

``ShardBackend`` is the whole interface the worker needs (``dim``, ``rows``, ``update``,
``update_lookup``), so a shard can be an in-process store (``InProcessShard``, tests and single-process
training) or a PS process over gRPC (``serving.ps.client.PSClient``, the one PS client), or several
replica processes of one shard (``serving.worker.replicas.ReplicaSet``). ``rows`` names the version
to read ("" = the newest) and says which (version, delta seq) it read, per call. Backends may also
expose ``version`` ((version, delta_seq) of the last answer, for Stats) and ``close()``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from features.hashing import shard_of
from serving.ps.client import PSClient, ShardError

if TYPE_CHECKING:
    from serving.ps.shard import TableShard

__all__ = ["HashRouter", "InProcessShard", "PSClient", "RemoteShard", "ShardBackend", "ShardError"]


@runtime_checkable
class ShardBackend(Protocol):
    @property
    def dim(self) -> int:
        """The embedding dim (an attribute or a read-only property)."""
        ...

    def rows(
        self, signs: np.ndarray, insert: bool, version: str = "", timeout_s: float | None = None
    ) -> tuple[np.ndarray, tuple[str, int]]:
        """Rows float32 (n, dim) for uint64 ``signs`` of ``version`` and the (version, delta seq)
        they came from; ``insert`` gives unseen signs a row; ``timeout_s``: what is left of the
        caller's deadline (None: the backend's own)."""
        ...

    def update(self, signs: np.ndarray, grads: np.ndarray) -> object:
        """Apply float32 (n, dim) gradients with the shard's sparse optimizer (what it returns,
        e.g. ``PSClient``'s step, is not used)."""
        ...

    def update_lookup(
        self, signs: np.ndarray, grads: np.ndarray, lookup: np.ndarray, timeout_s: float | None = None
    ) -> tuple[np.ndarray, tuple[str, int]]:
        """``update`` then ``rows(lookup, insert=True)`` read after it, in one call (a PS: one
        round trip, the training step's); either may be empty."""
        ...


class RemoteShard(ShardBackend, Protocol):
    """A shard in other processes (``PSClient``, ``ReplicaSet``): named by ``target``, with a gRPC
    health and a connection to close."""

    target: str

    def health(self) -> str: ...

    def close(self) -> None: ...


class HashRouter:
    """Splits signs by owning shard with ``features.hashing.shard_of`` (the one routing function)."""

    def __init__(self, num_shards: int):
        if num_shards < 1:
            raise ValueError("need at least one shard")
        self.num_shards = num_shards

    def split(self, signs: np.ndarray) -> list[np.ndarray | None]:
        """Per shard, the positions in ``signs`` it owns (None: all of them, single shard)."""
        if self.num_shards == 1:
            return [None]
        owner = shard_of(signs, self.num_shards)
        order = np.argsort(owner, kind="stable")
        counts = np.bincount(owner, minlength=self.num_shards)
        parts: list[np.ndarray | None] = [*np.split(order, np.cumsum(counts)[:-1])]
        return parts


class InProcessShard:
    """An in-process ``TableShard`` as a shard."""

    def __init__(self, store: TableShard):
        self.store = store
        self.dim = store.config.dim

    def rows(
        self, signs: np.ndarray, insert: bool, version: str = "", timeout_s: float | None = None
    ) -> tuple[np.ndarray, tuple[str, int]]:
        rows, _, answered = self.store.rows_of(signs, insert, version)
        return rows, answered

    def update(self, signs: np.ndarray, grads: np.ndarray) -> None:
        self.store.apply_gradients(signs, grads)

    def update_lookup(
        self, signs: np.ndarray, grads: np.ndarray, lookup: np.ndarray, timeout_s: float | None = None
    ) -> tuple[np.ndarray, tuple[str, int]]:
        if len(signs):
            self.update(signs, grads)
        return self.rows(lookup, True)

    @property
    def version(self) -> tuple[str, int]:
        return self.store.version, self.store.delta_seq
