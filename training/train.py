"""Train a recommendation model: sparse rows on the embedding PS, dense network with torch (DDP).

Reads top to bottom: config -> data -> embeddings (PS shards + worker) -> dense model -> epochs
(with evaluation, progress and delta cuts) -> export to the model store. One process, or one per
rank under torchrun (``WORLD_SIZE`` > 1): the data streams from disk every epoch (training/data.py)
and every rank reads its own pieces of the training rows, rank 0 starts the PS shards and hands
their addresses to the others, dense gradients are all-reduced by DDP (gloo on CPU, NCCL on GPU:
``training/ranks.py``), sparse updates go straight from each rank's worker to the shards. Rank 0
evaluates and exports. Everything started here is stopped at the end, on error too.

    recserve train --arch dlrm --epochs 3 --store artifacts --model criteo
    recserve train --data 'logs/day-*.tsv.gz' --test logs/test.parquet --epochs 1
    torchrun --nproc-per-node 2 -m recserve train --epochs 3
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

import model_store
from features.schema import load_schema
from features.stream import ReadOptions
from serving.ps.config import StoreConfig
from serving.rpc.auth import new_token_file
from training import data, ranks
from training import plan as sharding
from training.checkpoint import Checkpointer, checkpoint_dir, latest, parse_every
from training.cluster import Cluster, open_cluster, start_shards, stop_processes
from training.config import TrainConfig
from training.ctx import Profile, TrainCtx, unwrap
from training.evaluate import EvalResult, History, evaluate, plot_curve
from training.export import DeltaTrigger, VersionWriter
from training.inprocess import InProcessCtx, SignTable, sparse_optimizer
from training.metrics import TrainMetrics
from training.models import ModelConfig, build_model
from training.plan import ShardingPlan
from training.replicated import Replicated

log = logging.getLogger("recserve.train")


@dataclass
class TrainResult:
    """What a run produced (rank 0 holds the evaluation and the exported version)."""

    auc: float = float("nan")
    logloss: float = float("nan")
    samples_per_s: float = 0.0  # training rows per second over all ranks, epoch loops only (reading overlaps)
    train_seconds: float = 0.0
    steps: int = 0
    version_dir: str | None = None
    curve: str | None = None
    history: History = field(default_factory=History)
    evaluation: EvalResult | None = None
    dense_state: dict | None = None  # the dense network's final weights (rank-local copy)
    ps: dict = field(default_factory=dict)  # rank 0: ps_rows, evictions, expired, grows (Cluster.stats)
    replicated_digest: str = ""  # under torchrun: "rows:hash" of the replicated tables, equal on every rank


def train(cfg: TrainConfig) -> TrainResult:
    # ---- distributed setup ---------------------------------------------------------------------
    device = ranks.choose_device(cfg.device)
    rank, world = ranks.join(device)
    try:
        return _train(cfg, rank, world, device)
    finally:
        if world > 1:
            dist.destroy_process_group()


def _train(cfg: TrainConfig, rank: int, world: int, device: torch.device) -> TrainResult:
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 2) // 2))
    torch.manual_seed(cfg.seed)  # identical dense init on every rank (DDP also broadcasts it)

    # ---- data: streamed every epoch; one pass first counts every rank's rows and dense moments --
    # the schema stays the file as loaded (the feature contract, fingerprinted); the statistics
    # fitted here belong to this version's dense network (ModelConfig), which applies them
    schema = load_schema(cfg.schema)
    read = ReadOptions(format=cfg.data_format, block_size=cfg.block_size, numeric_dense=True)
    train_split = data.Split(cfg.data, schema, read, cfg.limit, part=(rank, world))
    scans = ranks.all_ranks(train_split.scan(), world)
    dense_mean = dense_std = None
    if cfg.dense_stats and schema.dense:  # over all ranks' rows, so every rank gets the same ones
        stats = functools.reduce(data.Scan.merge, scans).stats(schema)
        dense_mean = [stats[s.name][0] for s in schema.dense]
        dense_std = [stats[s.name][1] for s in schema.dense]
    test_split = data.Split(cfg.test, schema, read)
    # DDP needs the same number of steps on every rank: the ranks with more rows drop the rest
    steps_per_epoch = min(-(-s.rows // cfg.batch_size) for s in scans)
    if steps_per_epoch == 0:
        raise ValueError(
            f"{cfg.data}: no training rows" + (f" for one of the {world} ranks" if world > 1 else "")
        )
    log.info(
        "rank %d/%d: %d training rows, %d steps per epoch", rank, world, scans[rank].rows, steps_per_epoch
    )

    # ---- dense model ---------------------------------------------------------------------------
    model_cfg = ModelConfig(
        kind=cfg.arch,
        num_slots=len(schema.sparse),
        dim=cfg.table.dim,
        num_dense=len(schema.dense),
        bottom_mlp=[*cfg.bottom_mlp[:-1], cfg.table.dim],  # DLRM: the bottom output is a dim-wide field
        top_mlp=cfg.top_mlp,
        dropout=cfg.dropout,
        dense_mean=dense_mean,
        dense_std=dense_std,
    )
    model: nn.Module = build_model(model_cfg).to(device)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    # foreach: one multi-tensor kernel per step instead of a Python loop over ~10 tensors (4x
    # faster on CPU, where torch does not default to it)
    dense_opt = torch.optim.Adam(model.parameters(), lr=cfg.dense_lr, foreach=True)

    with contextlib.ExitStack() as stack:
        metrics = TrainMetrics(cfg.metrics_port, cfg.metrics_host, rank)
        stack.callback(metrics.close)
        # ---- embeddings: PS shards + worker, or the in-process baseline --------------------
        cluster: Cluster | None = None
        plan: ShardingPlan | None = None
        ctx: InProcessCtx | TrainCtx
        if cfg.embeddings == "inprocess":
            if world > 1:
                raise ValueError("embeddings=inprocess is a single-process baseline")
            vocab = train_split.batches(cfg.batch_size)  # one extra pass for the vocabulary
            table = SignTable.from_batches(vocab, schema, cfg.table.dim, cfg.table.init_scale, cfg.seed).to(
                device
            )
            ctx = InProcessCtx(
                table, model, dense_opt, sparse_optimizer(cfg.table.optimizer, table.parameters()), schema
            )
        else:
            plan = sharding.for_training(cfg, schema, read, sum(s.rows for s in scans), world)
            local = plan.local_mask(schema)
            store = cfg.store_config(schema.fingerprint)
            cluster = stack.enter_context(_open_cluster(cfg, schema, store, rank, world))
            if local.any():
                cluster.replicated = Replicated(
                    store, plan.replicated_rows(cfg.table.capacity), world, plan.rank_budget_gb
                )
            profile = Profile() if cfg.profile else None
            ctx = TrainCtx(cluster.worker, model, dense_opt, schema, cfg.prefetches, cluster.replicated,
                           local, profile)  # fmt: skip
            stack.callback(ctx.close)
            if cfg.staleness > 0 and (~local).any():
                log.info("asynchronous sparse updates (staleness %d): runs are not bit-reproducible; "
                         "--staleness 0 with a seed is", cfg.staleness)  # fmt: skip

        writer = None
        if rank == 0 and cfg.export and cluster is not None:
            writer = VersionWriter(cfg.store, cfg.model)
            stack.callback(lambda: writer.abort() if writer.staging.exists() else None)
        deltas = DeltaTrigger(cfg.delta_interval_s, cfg.delta_rows)

        # ---- checkpoints: where a restart continues (training/checkpoint.py) --------------------
        result = TrainResult()
        history = result.history
        step, rows, train_time, start_epoch, skip = 0, 0, 0.0, 0, 0
        ckpt_dir = checkpoint_dir(cfg.store, cfg.model, cfg.checkpoint_dir)
        checkpoints = Checkpointer(
            ckpt_dir, parse_every(cfg.checkpoint_every), cfg.checkpoint_keep, rank, world,
            sync=lambda: dist.barrier() if world > 1 else None, agree=functools.partial(ranks.agree, world),
        )  # fmt: skip
        if cfg.resume:
            resumed = latest(ckpt_dir)
            if resumed is None:
                log.warning("--resume: no complete checkpoint in %s yet: starting at step 0", ckpt_dir)
            else:
                resumed.check(world, cfg.to_dict())
                if rank == 0 and cluster is not None:
                    loaded = cluster.load(resumed.path / "ps")
                    log.info("resumed the PS shards from %s: %d rows", resumed.path, loaded)
                if cluster is not None and cluster.replicated is not None:  # every rank's copy
                    ids = np.zeros(1 << 16, bool)
                    ids[[s.id for s, mine in zip(schema.sparse, local, strict=True) if mine]] = True
                    cluster.replicated.load(resumed.path / "ps", ids)
                saved = resumed.dense_state()
                unwrap(model).load_state_dict(saved["model"])
                dense_opt.load_state_dict(saved["optimizer"])
                torch.set_rng_state(resumed.rank_state(rank)["torch_rng"])
                step, rows, train_time = resumed.step, saved["rows"], saved["train_time"]
                history.__dict__.update(saved["history"])
                start_epoch, skip = resumed.meta["epoch"], resumed.meta["in_epoch"]
                log.info("rank %d resumes at step %d (epoch %d, batch %d)", rank, step, start_epoch + 1, skip)
                if world > 1:
                    dist.barrier()  # every rank has read the checkpoint before a new one replaces it

        # ---- training loop ---------------------------------------------------------------------
        loss_fn = nn.BCEWithLogitsLoss()
        total = cfg.epochs * steps_per_epoch
        bar = tqdm(
            total=total, initial=step, disable=not cfg.progress or rank != 0, unit="batch", dynamic_ncols=True
        )
        for epoch in range(start_epoch, cfg.epochs):
            model.train()
            t0 = time.perf_counter()
            rng = np.random.default_rng([cfg.seed, epoch, rank])
            in_epoch = skip if epoch == start_epoch else 0
            metrics.epoch.set(epoch + 1)
            epoch_batches = train_split.batches(
                cfg.batch_size, cfg.shuffle_buffer, rng, steps_per_epoch, skip=in_epoch
            )
            for batch in ctx.steps(data.in_background(epoch_batches)):
                logits = ctx.forward(batch)
                loss = loss_fn(logits, torch.from_numpy(batch.labels).to(logits.device))
                ctx.backward(loss)
                step += 1
                in_epoch += 1
                rows += batch.num_rows
                history.steps.append(step)
                history.loss.append(loss.item())  # note: a sync point on GPU, cheap on CPU
                metrics.samples.inc(batch.num_rows)
                metrics.steps.inc()
                metrics.loss.set(history.loss[-1])
                if writer is not None and deltas.enabled and deltas.due(batch.num_rows * world):
                    writer.cut_delta(cluster)
                if checkpoints.every.enabled and checkpoints.due(step):
                    ctx.flush()  # every rank's sparse updates are on the shards before they dump
                    t_ckpt = time.perf_counter()
                    checkpoints.save(
                        step, epoch, in_epoch, cluster, unwrap(model), dense_opt,
                        extra={"rows": rows, "history": history.to_dict(),
                               "train_time": train_time + time.perf_counter() - t0},
                        config=cfg.to_dict(),
                    )  # fmt: skip
                    metrics.checkpoint_seconds.observe(time.perf_counter() - t_ckpt)
                    metrics.checkpoint_step.set(step)
                bar.update()
                bar.set_postfix(epoch=epoch + 1, loss=f"{history.loss[-1]:.4f}", refresh=False)
            ctx.flush()  # every sparse update applied before evaluating
            train_time += time.perf_counter() - t0
            if cluster is not None and cluster.replicated is not None and world > 1:
                result.replicated_digest = cluster.replicated.check_equal()
                log.info("epoch %d: the replicated tables are equal on all %d ranks (rows:digest %s)",
                         epoch + 1, world, result.replicated_digest)  # fmt: skip
            if rank == 0 and cluster is not None:
                cluster.expire()
                result.ps = cluster.stats()
                log.info(
                    "epoch %d: the PS holds %d rows, the replicated tables %d; %d evicted, %d expired, "
                    "grew %d times", epoch + 1,
                    *(result.ps[k] for k in ("ps_rows", "replicated_rows", "evictions", "expired", "grows")),
                )  # fmt: skip

            # ---- evaluation (rank 0; the others wait at the barrier) ---------------------------
            if world > 1:
                dist.barrier()
            if rank == 0:
                result.evaluation = evaluate(ctx, data.in_background(test_split.batches(cfg.eval_batch_size)))
                history.eval_steps.append(step)
                history.auc.append(result.evaluation.auc)
                history.logloss.append(result.evaluation.logloss)
                metrics.auc.set(result.evaluation.auc)
                bar.write(
                    f"epoch {epoch + 1}/{cfg.epochs}: test AUC {result.evaluation.auc:.4f} "
                    f"logloss {result.evaluation.logloss:.4f}"
                )
            if world > 1:
                dist.barrier()
        bar.close()
        if cluster is not None and ctx.profile is not None:  # type: ignore[union-attr]
            log.info("rank %d %s", rank, ctx.profile.table())  # type: ignore[union-attr]

        result.steps, result.train_seconds = step, train_time
        result.samples_per_s = rows * world / train_time if train_time else 0.0
        result.dense_state = {k: v.detach().cpu().clone() for k, v in unwrap(model).state_dict().items()}
        if rank == 0:
            ev = result.evaluation
            if ev is None:
                raise RuntimeError("rank 0 finished training without an evaluation (no epoch ran)")
            result.auc, result.logloss = ev.auc, ev.logloss

            # ---- training curve and export ----------------------------------------------------
            curve = cfg.curve or (str(writer.staging / "eval" / "curve.png") if writer is not None else "")
            if curve:
                result.curve = str(plot_curve(history, curve, title=f"{cfg.model}: {cfg.arch}"))
            if writer is not None:
                version = writer.finish(
                    cluster,
                    unwrap(model).cpu(),
                    model_cfg.to_dict(),
                    schema,
                    ev,
                    train=model_store.TrainRecord(
                        config=cfg.to_dict(),
                        world_size=world,
                        steps=step,
                        plan=plan.to_dict() if plan is not None else None,
                    ),
                )
                result.version_dir = str(version)
                if cluster is not None:  # the shards now hold the replicated tables too
                    result.ps = cluster.stats()
                if not cfg.curve:
                    result.curve = str(version / "eval" / "curve.png")
                if cfg.publish:
                    model_store.publish(cfg.store, cfg.model, writer.version)
                    log.info("published %s/%s", cfg.model, writer.version)
        if world > 1:
            dist.barrier()  # the other ranks keep rank 0's shards up until the export is done
        return result


def _open_cluster(cfg: TrainConfig, schema, store: StoreConfig, rank: int, world: int) -> Cluster:
    """Rank 0 starts (or connects to) the shards; the other ranks connect to the same addresses."""
    from serving.worker.core import WorkerConfig

    # a prefetched lookup is one batch staler than the worker knows: it counts as one of the K
    staleness = cfg.staleness - 1 if cfg.prefetches else cfg.staleness
    worker_cfg = WorkerConfig(staleness=staleness, update_threads=cfg.update_threads)
    if world == 1:
        return open_cluster(
            schema, store, cfg.num_shards, worker_cfg, cfg.ps, cfg.inprocess_ps,
            token_file=cfg.ps_token_file, data_root=cfg.store,
        )  # fmt: skip
    if cfg.inprocess_ps:
        raise ValueError("--inprocess-ps cannot be shared by several ranks; use PS processes")
    if cfg.ps:  # standalone shards: every rank connects to them with the token file on its host
        return open_cluster(schema, store, len(cfg.ps), worker_cfg, cfg.ps, token_file=cfg.ps_token_file)
    return _job_shards(cfg, schema, store, worker_cfg, rank, world)


def _job_shards(cfg: TrainConfig, schema, store: StoreConfig, worker_cfg, rank: int, world: int) -> Cluster:
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
            host = cfg.ps_host or (_node_address() if len(nodes) > 1 else "127.0.0.1")
            try:
                procs, addresses = start_shards(store, cfg.num_shards, Path(log_dir.name), str(token_path),
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
        cluster = open_cluster(schema, store, cfg.num_shards, worker_cfg,
                               [where[i] for i in range(cfg.num_shards)], token_file=str(token_path))  # fmt: skip
    except BaseException:
        stop_processes(procs)
        log_dir.cleanup()
        raise
    cluster.procs, cluster.log_dir = procs, log_dir  # stopped and removed with the cluster
    return cluster


def _node_address() -> str:
    """This node's address toward the rendezvous host (torchrun's MASTER_ADDR): the interface the
    other nodes reach it on. A UDP connect sends nothing; it only picks the route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((os.environ["MASTER_ADDR"], int(os.environ.get("MASTER_PORT", "29500"))))
        return s.getsockname()[0]
