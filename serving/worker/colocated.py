"""Co-located lookups: a version's embedding shards read inside the scoring process itself.

When a model version's shard files are on the scoring host (the model store is a local disk or a
mount every host shares), the scoring process maps them and gathers rows in-process with the same
code a serving PS runs (``serving.ps.mapped.MappedTableShard`` over ``serving.ps.table.BucketTable``): no
gRPC hop, no encoding of signs or rows. The files are mapped read-only, so every process on the
host that maps a version shares one copy of its rows in the page cache: N scoring processes cost
one copy, not N.

A ``ColocatedShard`` is one shard of ONE version: its ``Follower`` is pinned to the version the
scorer's dense model was exported with, so it serves exactly those rows, applies that version's
deltas as they are published (polled by a background thread, ``follow_beside_requests``, when a notice of
its version's next delta arrives, ``serving.notices``, and every ``poll_s`` anyway; each delta
flipped in atomically, as in a PS), and never switches to another version: a scorer of
the next version maps the next version's files (``serving.scoring``). The pin check (a version it does
not hold answers ``ShardError(not_serving=True)``, a 503) and the (version, delta seq) of every
answer are the PS's own; a version whose files fail their checksums or the gate is refused at
construction, with a ``StoreError`` saying why, so a scorer over it never starts.

``ShardBackend`` (``serving.worker.shards``) is all the worker sees; ``local = True`` tells it to
run the gather on the calling thread rather than through its fan-out pool.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np

import model_store as ms
from model_store import shards
from model_store.errors import StoreError
from serving.notices import Notices, Wake
from serving.ps.client import ShardError
from serving.ps.config import TableShardConfig
from serving.ps.follow import Follower, follow_beside_requests, not_serving_reason
from serving.ps.mapped import MappedTableShard
from serving.ps.spec import TableSpec
from serving.rpc.errors import NotServing

log = logging.getLogger("recserve.worker.colocated")

__all__ = ["ColocatedShard", "has_local_files"]


def has_local_files(version_dir: str | Path, shard: int, num_shards: int) -> bool:
    """Whether shard ``shard`` of ``num_shards`` of the version at ``version_dir`` has its complete
    dump on this host (its ``_SUCCESS`` marker is written last: a half-copied shard is not local)."""
    d = Path(version_dir) / "embeddings" / shards.shard_dir_name(shard, num_shards)
    return (d / ms.SUCCESS).is_file()


class ColocatedShard:
    """Shard ``shard`` of ``num_shards`` of the version at ``version_dir``, mapped in this process."""

    local = True

    def __init__(
        self, version_dir: str | Path, shard: int, num_shards: int, dim: int, poll_s: float = 5.0,
        dtype: str = "float32", notices: Notices | None = None,
    ):  # fmt: skip
        vdir = Path(version_dir)
        self.shard, self.num_shards, self.dim = shard, num_shards, dim
        self.target = f"local:{vdir / 'embeddings' / shards.shard_dir_name(shard, num_shards)}"
        self.store = MappedTableShard(
            TableShardConfig(table=TableSpec(dim=dim, dtype=dtype), shard=shard, num_shards=num_shards)
        )
        self.follower = Follower(self.store, vdir.parent, pin=vdir.name)
        self._poll_s = poll_s
        self._stop = threading.Event()
        self.poll(turn=False)  # the version itself (full-speed checksum pass: nothing is served yet)
        if not self.store.version:  # refused (a checksum, the gate): it never will be; say why now
            raise StoreError(not_serving_reason(self.store, self.follower))
        self._wake = Wake(notices, self.follower.wants)
        self._thread = threading.Thread(target=self._follow, name=f"colocated-{shard}", daemon=True)
        self._thread.start()

    # ---- ShardBackend ---------------------------------------------------------------------------
    def rows(
        self, signs: np.ndarray, insert: bool, version: str = "", timeout_s: float | None = None
    ) -> tuple[np.ndarray, tuple[str, int]]:
        if insert:
            raise ValueError("co-located shards serve a published version: they do not insert rows")
        if not self.store.version:  # never default rows for no version
            raise ShardError(
                not_serving_reason(self.store, self.follower), code="UNAVAILABLE", not_serving=True
            )
        try:
            rows, _, answered = self.store.rows_of(signs, version=version)
        except NotServing as e:  # pinned to a version this shard does not hold
            raise ShardError(str(e), code="UNAVAILABLE", not_serving=True) from None
        return rows, answered

    def update(self, signs: np.ndarray, grads: np.ndarray) -> None:
        raise self._not_trained()

    def update_lookup(self, signs, grads, lookup, timeout_s=None) -> tuple[np.ndarray, tuple[str, int]]:
        raise self._not_trained()

    def _not_trained(self) -> ValueError:
        return ValueError(f"co-located shard {self.shard} serves a published version: it is not trained")

    @property
    def version(self) -> tuple[str, int]:
        return self.store.version, self.store.delta_seq

    def health(self) -> str:
        return "SERVING" if self.store.version else "NOT_SERVING"

    # ---- following the version's deltas ---------------------------------------------------------
    def poll(self, turn: bool = True) -> list[str]:
        """One pass of the follower (the version at first, then its new deltas; ``turn``: in one of
        the host's apply slots, ``Follower.poll``). The version's load is logged at INFO, each
        delta applied after it at DEBUG: a TorchServe worker's lines go through the JVM's log
        pipeline, which cost it 6-10 ms of CPU per delta (two shards' lines), taken at the moment
        a delta's appliers all wake (bench-swap's stack, 10 deltas, no load: 7-10 ms against 1 ms). Refusals are errors (``VersionTarget.refuse``); each
        answer names the delta it read, and ``recserve serve``'s /metrics each shard's last
        (``serving.freshness``)."""
        before = self.store.version
        events = self.follower.poll(turn)
        level = logging.INFO if self.store.version != before else logging.DEBUG
        for event in events:
            log.log(level, "shard %d (co-located): %s", self.shard, event)
        return events

    def _follow(self) -> None:
        follow_beside_requests()
        while not self._stop.is_set():
            self._wake.wait(self._poll_s)
            if self._stop.is_set():
                break
            try:
                self.poll()
            except Exception:  # keep serving what we have; the next poll retries
                log.exception("shard %d (co-located): follow poll failed", self.shard)

    def close(self) -> None:
        """Stop following and drop this process's page-table entries of the mapped rows (the page
        cache keeps the pages for other processes; the mappings go with the last reference)."""
        self._stop.set()
        self._wake.set()
        self._wake.close()
        self._thread.join(5)
        self.store.served.base.release(pause_s=0.0)
