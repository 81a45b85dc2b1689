"""The training job's PS shards: the ones given by address (``--ps``), in-process ones
(``--inprocess-ps``), or under torchrun the job's own, started by each node's local rank 0 and
found by every rank through the process group."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from serving.rpc.auth import new_token_file
from training.cluster import Cluster, open_cluster, start_shards, stop_processes
from training.config import TrainConfig
from training.ranks import node_address

if TYPE_CHECKING:
    from serving.ps.config import TableShardConfig

log = logging.getLogger("recserve.train")


def open_job_cluster(cfg: TrainConfig, schema, spec: TableShardConfig, rank: int, world: int) -> Cluster:
    """Rank 0 starts (or connects to) the shards; the other ranks connect to the same addresses."""
    from serving.worker.core import WorkerConfig

    # a prefetched lookup is one batch staler than the worker knows: it counts as one of the K
    staleness = cfg.staleness - 1 if cfg.prefetches else cfg.staleness
    worker_cfg = WorkerConfig(staleness=staleness, update_threads=cfg.update_threads)
    if world == 1:
        return open_cluster(
            schema, spec, cfg.num_shards, worker_cfg, cfg.ps, cfg.inprocess_ps,
            token_file=cfg.ps_token_file, data_root=cfg.store,
        )  # fmt: skip
    if cfg.inprocess_ps:
        raise ValueError("--inprocess-ps cannot be shared by several ranks; use PS processes")
    if cfg.ps:  # standalone shards: every rank connects to them with the token file on its host
        return open_cluster(schema, spec, len(cfg.ps), worker_cfg, cfg.ps, token_file=cfg.ps_token_file)
    return _job_shards(cfg, schema, spec, worker_cfg, rank, world)


def _job_shards(
    cfg: TrainConfig, schema, spec: TableShardConfig, worker_cfg, rank: int, world: int
) -> Cluster:
    """The job's own shards under torchrun: shard i runs on node i mod N (N nodes, torchrun's
    GROUP_RANK), started by that node's local rank 0 and bound to the node's address (loopback
    when the job has one node); every rank learns every address through the process group, and
    one admin token (rank 0's, sent to every rank) guards their writes."""
    node, local_rank = int(os.environ.get("GROUP_RANK", "0")), int(os.environ.get("LOCAL_RANK", str(rank)))
    placement: list = [None] * world
    dist.all_gather_object(placement, (node, local_rank))
    nodes = sorted({n for n, _ in placement})
    if sorted(n for n, lr in placement if lr == 0) != nodes:
        raise RuntimeError(f"every node needs one local rank 0 to start its PS shards: {placement}")
    log_dir = tempfile.TemporaryDirectory(prefix="recserve-ps-")  # mode 0700
    procs: list = []
    try:
        token_path = Path(log_dir.name) / "admin.token"
        token = [new_token_file(token_path).read_text().strip() if rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        if rank != 0:
            new_token_file(token_path, str(token[0]))
        mine = [i for i in range(cfg.num_shards) if nodes[i % len(nodes)] == node] if local_rank == 0 else []
        started: tuple[dict, str] = ({}, "")
        if mine:
            host = cfg.ps_host or (node_address() if len(nodes) > 1 else "127.0.0.1")
            try:
                procs, addresses = start_shards(spec, cfg.num_shards, Path(log_dir.name), str(token_path),
                                                cfg.store, shards=mine, host=host)  # fmt: skip
                started = (dict(zip(mine, addresses, strict=True)), "")
                log.info("node %d started PS shards %s at %s", node, mine, ", ".join(addresses))
            except Exception as e:  # the other ranks wait for our addresses: tell them why not
                started = ({}, f"node {node} ({socket.gethostname()}): {e}")
        everyone: list = [None] * world
        dist.all_gather_object(everyone, started)
        if errors := [err for _, err in everyone if err]:
            raise RuntimeError("the job's PS shards did not start: " + "; ".join(errors))
        where = {i: a for addresses, _ in everyone for i, a in addresses.items()}
        cluster = open_cluster(schema, spec, cfg.num_shards, worker_cfg,
                               [where[i] for i in range(cfg.num_shards)], token_file=str(token_path))  # fmt: skip
    except BaseException:
        stop_processes(procs)
        log_dir.cleanup()
        raise
    cluster.procs, cluster.log_dir = procs, log_dir  # stopped and removed with the cluster
    return cluster
