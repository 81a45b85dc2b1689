"""A PS shard process's steps around its servicer (``serving.ps.server.serve`` runs them in order):
``open_store`` (a training ``TableShard`` with its kernels warmed up, or a serving shard's
``MappedTableShard``), ``start_following`` (a serving shard's ``Follower``, polled once), ``Health``
(gRPC health kept true to what is served), ``log_listening``, and the ``Background`` loops (TTL
expiry; follow polls at each notice, on one low-priority thread)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from serving import freshness, notices
from serving.ps.config import ServingShardConfig, ShardConfig, TableShardConfig, TrainingShardConfig
from serving.ps.follow import follow_beside_requests, not_serving_reason

if TYPE_CHECKING:
    from serving.ps.server import EmbeddingPSServicer

log = logging.getLogger("recserve.ps")


def open_store(config: ShardConfig, cfg: TableShardConfig):
    """The shard's store (configured by ``cfg``): a serving shard maps versions' files read-only
    (deltas in an overlay); a training one holds rows and optimizer state (compiled kernels:
    numba, warmed up here), loaded from ``--load`` when given."""
    if isinstance(config, ServingShardConfig):
        from serving.ps.mapped import MappedTableShard

        return MappedTableShard(cfg, keep_s=config.keep_previous_s)
    from serving.ps.shard import TableShard

    store = TableShard(cfg)
    _warm_up(cfg)
    if config.load:
        t0 = time.perf_counter()
        store.load(config.load)
        log.info("loaded %d rows from %s in %.2fs", len(store), config.load, time.perf_counter() - t0)
    return store


def _warm_up(cfg: TableShardConfig) -> None:
    """A training shard: load every compiled kernel the RPCs use (from numba's cache) for the
    read-only arrays that protobuf payloads give, so the first real call is not the slow one. A
    serving shard has nothing to warm up: its lookups are numpy."""
    from dataclasses import replace

    import numpy as np

    from serving.ps.shard import TableShard

    signs = np.frombuffer(np.array([1, 2, 2, 3], dtype="<u8").tobytes(), dtype="<u8")
    scratch = TableShard(
        replace(cfg.with_table(capacity=16, min_count=1, max_memory_gb=0.0), shard=0, num_shards=1)
    )
    grads = np.frombuffer(np.zeros((4, cfg.dim), dtype="<f4").tobytes(), dtype="<f4").reshape(4, cfg.dim)
    scratch.lookup(signs, insert=True)
    scratch.lookup(signs)
    scratch.apply_gradients(signs, grads)
    scratch.apply_gradients(signs[:1], grads[:1])


def start_following(config: ShardConfig, store, registry):
    """A serving shard's ``Follower``, having polled once so the published version (and its
    deltas) is served from the start; None for a training shard."""
    if not isinstance(config, ServingShardConfig):
        return None
    from serving.ps.follow import Follower

    follower = Follower(store, config.model_dir, registry=registry, pin=config.pin)
    for event in follower.poll():
        log.info("follow: %s", event)
    return follower


class Health:
    """gRPC health SERVING exactly while the shard serves a version; a change is logged once."""

    def __init__(self, running, store, follower):
        self.running, self.store, self.follower = running, store, follower
        self.reason: str | None = None  # None: not set yet

    async def update(self) -> None:
        from serving.rpc import server as rpc_server

        reason = not_serving_reason(self.store, self.follower)
        if reason == self.reason:
            return
        await rpc_server.set_serving_aio(self.running, not reason, reason)
        self.reason = reason
        if reason:
            log.warning("NOT_SERVING: %s", reason)
        elif self.follower is not None:
            log.info("SERVING version %s (delta %d)", self.store.version, self.store.delta_seq)


def log_listening(config: ShardConfig, store, port: int) -> None:
    cfg = store.config
    log.info(
        "ps shard %d/%d listening on %s:%d (dim %d, %s)",
        cfg.shard, cfg.num_shards, config.server.host, port, cfg.dim,
        "serving mapped versions" if isinstance(config, ServingShardConfig) else
        f"capacity {store.capacity}, eviction {cfg.eviction}, memory limit "
        + (f"{cfg.max_memory_gb:g} GiB" if cfg.max_memory_gb else "none"),
    )  # fmt: skip


class Background:
    """The shard's loops on the event loop: TTL expiry (training, ``ttl_s > 0``) and follow polls
    (serving), whose reads, checksums and overlay builds run on one low-priority thread."""

    def __init__(self, config: ShardConfig, servicer: EmbeddingPSServicer, health: Health):
        self.servicer, self.health, self.notices, self.pool = servicer, health, None, None
        self.store, self.follower, self.tasks = servicer.store, servicer.follower, []
        if isinstance(config, TrainingShardConfig) and config.store.ttl_s > 0:
            self.tasks.append(asyncio.create_task(self.expire_loop(config.expire_every_s)))
        if isinstance(config, ServingShardConfig) and self.follower is not None:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(1, "follow", initializer=follow_beside_requests)
            registry = getattr(servicer.metrics, "registry", None)  # --notices (None: the poll alone)
            self.notices = freshness.follow_notices(config.notices, config.model_dir, registry, "ps",
                                                    lambda: [(config.shard, self.follower)])  # fmt: skip
            self.tasks.append(asyncio.create_task(self.follow_loop(config.poll_s)))

    async def expire_loop(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            await self.servicer.writable()
            if n := self.store.expire():
                log.info("expired %d rows (%d in all)", n, self.store.expired)

    async def follow_loop(self, poll_s: float) -> None:
        loop, wake = asyncio.get_running_loop(), notices.AsyncWake(self.notices, self.follower.wants)
        while True:
            await wake.wait(poll_s)
            try:  # flips are atomic on the loop's side
                for event in await loop.run_in_executor(self.pool, self.follower.poll):
                    log.info("follow: %s", event)
                for version in await loop.run_in_executor(self.pool, self.store.release_idle):
                    log.info("released version %s: no lookup named it for %gs", version, self.store.keep_s)
            except Exception:  # keep serving what we have; the next poll retries
                log.exception("follow poll failed")
            await self.health.update()

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        if self.notices is not None:
            self.notices.close()
