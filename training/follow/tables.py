"""The streaming follower's embedding tables, loaded with the followed version and every delta
already cut into it (what serving holds): ``embedded``, in-process stores (one process, the
default), or ``shared``, PS processes that every rank of a torchrun job trains through
(``training.follow.ranks``)."""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import model_store as ms
from training.cluster import Cluster

if TYPE_CHECKING:
    from features.schema import Schema
    from model_store.manifest import TrainRecord, VersionManifest
    from serving.ps.config import TableShardConfig
    from serving.worker.core import WorkerConfig
    from training.follow.config import FollowConfig
    from training.follow.full_version import FullVersions
    from training.follow.ranks import Ranks
    from training.follow.types import Loaded

log = logging.getLogger("recserve.train.follow")


def store_config(cfg: FollowConfig, vdir: Path, num_shards: int, schema_hash: str,
                 trained: TrainRecord | None = None) -> TableShardConfig:  # fmt: skip
    """The follower's table: the spec (and optimizer) the version's rows were trained with, room
    for its rows and as many new ones (hash routing spreads rows evenly), and the follower's own
    eviction, memory limit and learning rate (``--lr``; unset: the version's, scaled by the
    follower's batch over the one the version was trained with, when ``trained`` says)."""
    from model_store.shards import read_meta, shard_dirs
    from serving.ps.shard import TableShardConfig
    from serving.ps.spec import TableSpec

    parts = shard_dirs(vdir / "embeddings")
    metas = [read_meta(part) for part in parts]
    spec = TableSpec.from_meta(metas[0], str(parts[0]))
    batch = trained.config.get("batch_size") if trained is not None else None
    table = replace(
        spec,
        capacity=max(cfg.capacity, 2 * sum(m.rows for m in metas) // num_shards + 1024),
        eviction=cfg.eviction,
        max_memory_gb=cfg.max_memory_gb,
        optimizer=replace(spec.optimizer, lr=learning_rate(cfg, spec.optimizer.lr, batch)),
    )
    return TableShardConfig(table, seed=metas[0].seed, schema_hash=schema_hash)


def learning_rate(cfg: FollowConfig, trained_lr: float, trained_batch: int | None) -> float:
    """``--lr``, else the version's rate times the follower's batch over the version's (the linear
    scaling rule: a sample's share of a step's mean gradient shrinks as the batch grows; on the
    Criteo split, 8,000 samples once, batch 1,024 at 8x the rate gave the progressive and test
    AUC of batch 128 at 1x: 0.7759 / 0.7177 against 0.7764 / 0.7175, and 0.7743 / 0.7116 at 1x)."""
    if cfg.lr:
        return cfg.lr
    return trained_lr * (cfg.batch_size / trained_batch if trained_batch else 1.0)


def open_tables(cfg: FollowConfig, vdir: Path, version: str, schema: Schema, manifest: VersionManifest,
                job: Ranks) -> Cluster:  # fmt: skip
    """The version's tables at what serving holds: in this process (one trainer), or the ranks'
    shared PS processes under torchrun (``job.seq``: the last delta seq they hold). Rows looked up
    ahead (``--staleness`` >= 1) miss the update between: the worker is one batch less stale."""
    from serving.worker.core import WorkerConfig

    n = manifest.num_shards
    store = store_config(cfg, vdir, n, schema.fingerprint, manifest.train)
    worker = WorkerConfig(staleness=max(0, cfg.staleness - 1), update_threads=cfg.update_threads)
    if job.world > 1:
        cluster, job.seq = shared(store, n, vdir, schema, worker, job, cfg.store)
        return cluster
    return embedded(store, n, vdir, version, schema, worker)


def load_version(cfg: FollowConfig, version: str, job: Ranks, full: FullVersions | None) -> Loaded:
    """``version`` ready to train: its files verified, its tables with every delta applied, its
    frozen dense network (``full``: trained beside the served one, shipped in full versions)."""
    from features.schema import load_schema
    from training.ctx import DenseOptimizer, TrainCtx
    from training.follow.full_version import FrozenDense, load_frozen_dense
    from training.follow.types import Loaded

    vdir = ms.version_dir(cfg.store, cfg.model, version)
    manifest = ms.read_manifest(vdir, verify=True)
    schema = load_schema(vdir / "schema.yaml")
    if schema.fingerprint != manifest.schema_fingerprint:
        raise ms.ModelStoreError(f"{vdir}: schema.yaml does not match the manifest's fingerprint")
    cluster = open_tables(cfg, vdir, version, schema, manifest, job)
    dense = load_frozen_dense(vdir / manifest.dense["torchscript"])
    optimizer: DenseOptimizer = FrozenDense()
    if full is not None:  # --train-dense
        dense, optimizer = full.dense(dense, manifest)
    assert cluster.worker is not None
    ctx = TrainCtx(cluster.worker, dense, optimizer, schema, prefetch=cfg.staleness >= 1)
    return Loaded(version, vdir, schema, cluster, ctx, dense, manifest)


def embedded(store: TableShardConfig, num_shards: int, vdir: Path, version: str, schema: Schema,
             worker: WorkerConfig) -> Cluster:  # fmt: skip
    """One ``TableShard`` per shard of the version in this process, behind a worker."""
    from serving.ps.shard import TableShard
    from serving.worker.core import EmbeddingWorker, InProcessShard

    stores = [TableShard(replace(store, shard=i, num_shards=num_shards)) for i in range(num_shards)]
    for s in stores:
        s.load(vdir / "embeddings")
        s.version = version  # deltas carry base_version = the served version
    apply_deltas(vdir, stores)
    return Cluster(
        EmbeddingWorker([InProcessShard(s) for s in stores], schema, worker), num_shards, stores=stores
    )


def apply_deltas(vdir: Path, stores: list) -> int:
    """Bring the stores to what serving holds: every complete delta after the full dump's seq, in
    order (a gap or a delta of another version is refused by the store). Returns deltas applied."""
    applied = 0
    for seq in ms.list_deltas(vdir, after=stores[0].delta_seq):
        for store in stores:
            store.apply_delta(ms.delta_dir(vdir, seq))
        applied += 1
    return applied


def shared(store: TableShardConfig, num_shards: int, vdir: Path, schema: Schema, worker: WorkerConfig,
           job: Ranks, data_root: str) -> tuple[Cluster, int]:  # fmt: skip
    """PS processes holding the version at ``vdir`` (its dump and deltas), started and loaded by
    rank 0 (its dumps under ``data_root``; bound to its node's address when the job's ranks are on
    several nodes, where the others reach them, writes taking rank 0's token), and this rank's
    worker over them; and the last delta seq they hold. Their deltas carry no base version (the
    version's dump names none)."""
    from serving.ps.client import PSClient
    from serving.rpc.auth import new_token_file
    from training.cluster import open_cluster, start_shards, stop_processes
    from training.ranks import node_address

    log_dir = tempfile.TemporaryDirectory(prefix="recserve-ps-")  # mode 0700
    token_path = Path(log_dir.name) / "admin.token"
    procs: list = []
    started: tuple[list[str], str, int, str] = ([], "", -1, "")  # addresses, token, seq, error
    try:
        if job.rank == 0:
            try:
                new_token_file(token_path)
                apart = int(os.environ.get("LOCAL_WORLD_SIZE", job.world)) < job.world  # ranks on other nodes
                procs, addresses = start_shards(store, num_shards, Path(log_dir.name), str(token_path), data_root,
                                                host=node_address() if apart else "127.0.0.1")  # fmt: skip
                seq = -1
                for address in addresses:
                    with PSClient(address, token_file=str(token_path)) as client:
                        client.load(str(vdir / "embeddings"))
                        for seq in ms.list_deltas(vdir):
                            client.load(str(ms.delta_dir(vdir, seq)), delta=True)
                started = (addresses, token_path.read_text().strip(), seq, "")
            except Exception as e:  # the other ranks wait for the addresses: tell them why not
                started = ([], "", -1, f"{type(e).__name__}: {e}")
        addresses, token, seq, error = job.broadcast(started)
        if error:
            raise RuntimeError(f"the job's PS shards did not start: {error}")
        if job.rank != 0:
            new_token_file(token_path, token)
        cluster = open_cluster(schema, store, num_shards, worker, addresses, token_file=str(token_path))
    except BaseException:
        stop_processes(procs)
        log_dir.cleanup()
        raise
    cluster.procs, cluster.log_dir = procs, log_dir  # stopped and removed with the cluster
    log.info(
        "rank %d of %d: PS shards at %s, delta %d applied", job.rank, job.world, ", ".join(addresses), seq
    )
    return cluster, seq
