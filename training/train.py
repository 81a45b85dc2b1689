"""Train a recommendation model: sparse rows on the embedding PS, dense network with torch (DDP).

``_train`` reads as its steps: data (one scan pass) -> dense model -> embeddings (PS shards +
worker) -> export staging and checkpoints -> resume -> epochs (train, end-of-epoch checks,
evaluation) -> finish (curve, export). One process, or one per rank under torchrun: every rank
streams its own pieces of the training rows every epoch (training/data.py), the job's PS shards
are started and shared as training/job_shards.py says, dense gradients are all-reduced by DDP
(gloo on CPU, NCCL on GPU: ``training/ranks.py``), sparse updates go straight from each rank's
worker to the shards. Rank 0 evaluates and exports. Everything started is stopped at the end.

    recserve train --arch dlrm --epochs 3 --store artifacts --model criteo
    recserve train --data 'logs/day-*.tsv.gz' --test logs/test.parquet --epochs 1
    torchrun --nproc-per-node 2 -m recserve train --epochs 3
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

import model_store
from training import data, ranks
from training.checkpoint import Checkpointer, checkpoint_dir, latest, parse_every
from training.cluster import Cluster
from training.config import TrainConfig
from training.ctx import Profile, TrainCtx, unwrap
from training.evaluate import EvalResult, History, evaluate, plot_curve
from training.export import DeltaTrigger, VersionWriter
from training.inprocess import InProcessCtx, SignTable, sparse_optimizer
from training.job_shards import open_job_cluster
from training.metrics import TrainMetrics
from training.models import ModelConfig, build_model
from training.planning import planner
from training.planning.plan import ShardingPlan
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
    job = _Job(cfg, rank, world, device, data.read_job(cfg, rank, world))
    job.build_model()
    with contextlib.ExitStack() as stack:
        job.open_embeddings(stack)
        job.open_export(stack)
        job.resume()
        job.show_progress(stack)
        for epoch in range(job.at.epoch, cfg.epochs):
            job.train_epoch(epoch)
            job.end_epoch(epoch)
            job.evaluate(epoch)
        return job.finish()


@dataclass
class _At:
    """Where the job stands (what a checkpoint keeps, training/checkpoint.py)."""

    epoch: int = 0
    in_epoch: int = 0  # batches of this epoch done (a resumed epoch skips them)
    step: int = 0
    rows: int = 0
    train_time: float = 0.0


class _Job:
    """One training job on one rank, in the steps ``_train`` takes."""

    def __init__(self, cfg: TrainConfig, rank: int, world: int, device: torch.device, inputs: data.JobData):
        self.cfg, self.rank, self.world, self.device, self.data = cfg, rank, world, device, inputs
        self.result = TrainResult()
        self.at = _At()
        self.cluster: Cluster | None = None
        self.plan: ShardingPlan | None = None
        self.replicated_mask: np.ndarray | None = None  # per sparse slot: its table is replicated
        self.writer: VersionWriter | None = None
        # set by the steps, in order
        self.model_cfg: ModelConfig
        self.model: nn.Module
        self.dense_opt: torch.optim.Optimizer
        self.metrics: TrainMetrics
        self.ctx: InProcessCtx | TrainCtx
        self.deltas: DeltaTrigger
        self.checkpoints: Checkpointer
        self.bar: tqdm

    # ---- dense model ---------------------------------------------------------------------------
    def build_model(self) -> None:
        """The dense network with this version's fitted statistics (its ModelConfig applies them),
        wrapped in DDP under torchrun, and its optimizer."""
        cfg, schema = self.cfg, self.data.schema
        dense_mean = dense_std = None
        if cfg.dense_stats and schema.dense:  # over all ranks' rows, so every rank gets the same ones
            stats = functools.reduce(data.Scan.merge, self.data.scans).stats(schema)
            dense_mean = [stats[s.name][0] for s in schema.dense]
            dense_std = [stats[s.name][1] for s in schema.dense]
        self.model_cfg = ModelConfig(
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
        device = self.device
        model: nn.Module = build_model(self.model_cfg).to(device)
        if self.world > 1:
            model = nn.parallel.DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None
            )
        self.model = model
        # foreach: one multi-tensor kernel per step instead of a Python loop over ~10 tensors (4x
        # faster on CPU, where torch does not default to it)
        self.dense_opt = torch.optim.Adam(model.parameters(), lr=cfg.dense_lr, foreach=True)

    # ---- embeddings: PS shards + worker, or the in-process baseline ----------------------------
    def open_embeddings(self, stack: contextlib.ExitStack) -> None:
        """Its metrics first (the port a scrape finds the job on), then the tables: on the PS
        shards (started, or connected to) behind a worker, replicated on every rank as the plan
        says; or in this process (the baseline)."""
        cfg, schema, world = self.cfg, self.data.schema, self.world
        self.metrics = TrainMetrics(cfg.metrics_port, cfg.metrics_host, self.rank)
        stack.callback(self.metrics.close)
        if cfg.embeddings == "inprocess":
            if world > 1:
                raise ValueError("embeddings=inprocess is a single-process baseline")
            vocab = self.data.train.batches(cfg.batch_size)  # one extra pass for the vocabulary
            table = SignTable.from_batches(vocab, schema, cfg.table.dim, cfg.table.init_scale, cfg.seed)
            table = table.to(self.device)
            optimizer = sparse_optimizer(cfg.table.optimizer, table.parameters())
            self.ctx = InProcessCtx(table, self.model, self.dense_opt, optimizer, schema)
            return
        rows = sum(s.rows for s in self.data.scans)
        plan = self.plan = planner.for_training(cfg, schema, self.data.read, rows, world)
        replicated_mask = self.replicated_mask = plan.replicated_mask(schema)
        spec = cfg.store_config(schema.fingerprint)
        cluster = self.cluster = stack.enter_context(open_job_cluster(cfg, schema, spec, self.rank, world))
        if replicated_mask.any():
            cluster.replicated = Replicated(
                spec, plan.replicated_rows(cfg.table.capacity), world, plan.rank_budget_gb
            )
        profile = Profile() if cfg.profile else None
        assert cluster.worker is not None  # open_job_cluster returns a connected cluster
        self.ctx = TrainCtx(cluster.worker, self.model, self.dense_opt, schema, cfg.prefetches,
                            cluster.replicated, replicated_mask, profile)  # fmt: skip
        stack.callback(self.ctx.close)
        if cfg.staleness > 0 and (~replicated_mask).any():
            log.info("asynchronous sparse updates (staleness %d): runs are not bit-reproducible; "
                     "--staleness 0 with a seed is", cfg.staleness)  # fmt: skip

    def open_export(self, stack: contextlib.ExitStack) -> None:
        """Rank 0 stages the version it exports (deltas cut while training land in it) and the
        cuts' trigger; the checkpoints every rank takes."""
        cfg, world = self.cfg, self.world
        if self.rank == 0 and cfg.export and self.cluster is not None:
            plan = self.plan or (ShardingPlan.load(cfg.plan) if cfg.plan else None)  # in-process: its dtype
            dtype = (plan.serving_dtype if plan else "") or cfg.table.serving_dtype  # a plan's wins
            writer = self.writer = VersionWriter(cfg.store, cfg.model, dtype)
            stack.callback(lambda: writer.abort() if writer.staging.exists() else None)
        self.deltas = DeltaTrigger(cfg.delta_interval_s, cfg.delta_rows)
        self.ckpt_dir = checkpoint_dir(cfg.store, cfg.model, cfg.checkpoint_dir)
        self.checkpoints = Checkpointer(
            self.ckpt_dir, parse_every(cfg.checkpoint_every), cfg.checkpoint_keep, self.rank, world,
            sync=lambda: dist.barrier() if world > 1 else None, agree=functools.partial(ranks.agree, world),
        )  # fmt: skip

    # ---- checkpoints: where a restart continues (training/checkpoint.py) -----------------------
    def resume(self) -> None:
        """Under --resume, continue from the latest complete checkpoint: the PS shards' rows, the
        replicated tables, the dense weights and optimizer, the RNG and the data position."""
        cfg, rank, cluster = self.cfg, self.rank, self.cluster
        if not cfg.resume:
            return
        resumed = latest(self.ckpt_dir)
        if resumed is None:
            log.warning("--resume: no complete checkpoint in %s yet: starting at step 0", self.ckpt_dir)
            return
        resumed.check(self.world, cfg.to_dict())
        if rank == 0 and cluster is not None:
            loaded = cluster.load(resumed.path / "ps")
            log.info("resumed the PS shards from %s: %d rows", resumed.path, loaded)
        if (
            cluster is not None and cluster.replicated is not None and self.replicated_mask is not None
        ):  # every rank's copy
            ids = np.zeros(1 << 16, bool)
            ids[
                [s.id for s, mine in zip(self.data.schema.sparse, self.replicated_mask, strict=True) if mine]
            ] = True
            cluster.replicated.load(resumed.path / "ps", ids)
        saved = resumed.dense_state()
        unwrap(self.model).load_state_dict(saved["model"])
        self.dense_opt.load_state_dict(saved["optimizer"])
        torch.set_rng_state(resumed.rank_state(rank)["torch_rng"])
        self.at = _At(resumed.meta["epoch"], resumed.meta["in_epoch"], resumed.step, saved["rows"],
                      saved["train_time"])  # fmt: skip
        self.result.history.__dict__.update(saved["history"])
        log.info("rank %d resumes at step %d (epoch %d, batch %d)", rank, self.at.step, self.at.epoch + 1,
                 self.at.in_epoch)  # fmt: skip
        if self.world > 1:
            dist.barrier()  # every rank has read the checkpoint before a new one replaces it

    # ---- training loop -------------------------------------------------------------------------
    def show_progress(self, stack: contextlib.ExitStack) -> None:
        cfg = self.cfg
        self.bar = stack.enter_context(
            tqdm(total=cfg.epochs * self.data.steps_per_epoch, initial=self.at.step, unit="batch",
                 disable=not cfg.progress or self.rank != 0, dynamic_ncols=True)
        )  # fmt: skip

    def train_epoch(self, epoch: int) -> None:
        cfg, at, history, metrics = self.cfg, self.at, self.result.history, self.metrics
        self.model.train()
        t0 = time.perf_counter()
        rng = np.random.default_rng([cfg.seed, epoch, self.rank])
        at.epoch, at.in_epoch = epoch, at.in_epoch if epoch == at.epoch else 0
        metrics.epoch.set(epoch + 1)
        steps = self.data.steps_per_epoch
        epoch_batches = self.data.train.batches(cfg.batch_size, cfg.shuffle_buffer, rng, steps, at.in_epoch)
        loss_fn = nn.BCEWithLogitsLoss()
        for batch in self.ctx.steps(data.in_background(epoch_batches)):
            logits = self.ctx.forward(batch)
            loss = loss_fn(logits, torch.from_numpy(batch.labels).to(logits.device))
            self.ctx.backward(loss)
            at.step += 1
            at.in_epoch += 1
            at.rows += batch.num_rows
            history.steps.append(at.step)
            history.loss.append(loss.item())  # note: a sync point on GPU, cheap on CPU
            metrics.samples.inc(batch.num_rows)
            metrics.steps.inc()
            metrics.loss.set(history.loss[-1])
            if (
                self.writer is not None
                and self.deltas.enabled
                and self.deltas.due(batch.num_rows * self.world)
            ):
                self.writer.cut_delta(self.cluster)
            if self.checkpoints.every.enabled and self.checkpoints.due(at.step):
                self._checkpoint(at.train_time + time.perf_counter() - t0)
            self.bar.update()
            self.bar.set_postfix(epoch=epoch + 1, loss=f"{history.loss[-1]:.4f}", refresh=False)
        self.ctx.flush()  # every sparse update applied before evaluating
        at.train_time += time.perf_counter() - t0

    def _checkpoint(self, train_time: float) -> None:
        at = self.at
        self.ctx.flush()  # every rank's sparse updates are on the shards before they dump
        t0 = time.perf_counter()
        self.checkpoints.save(
            at.step, at.epoch, at.in_epoch, self.cluster, unwrap(self.model), self.dense_opt,
            extra={"rows": at.rows, "history": self.result.history.to_dict(), "train_time": train_time},
            config=self.cfg.to_dict(),
        )  # fmt: skip
        self.metrics.checkpoint_seconds.observe(time.perf_counter() - t0)
        self.metrics.checkpoint_step.set(at.step)

    def end_epoch(self, epoch: int) -> None:
        """The replicated tables are checked equal on every rank; rank 0 expires rows (TTL) and
        logs the PS's size."""
        cluster, result = self.cluster, self.result
        if cluster is not None and cluster.replicated is not None and self.world > 1:
            result.replicated_digest = cluster.replicated.check_equal()
            log.info("epoch %d: the replicated tables are equal on all %d ranks (rows:digest %s)",
                     epoch + 1, self.world, result.replicated_digest)  # fmt: skip
        if self.rank == 0 and cluster is not None:
            cluster.expire()
            result.ps = cluster.stats()
            log.info(
                "epoch %d: the PS holds %d rows, the replicated tables %d; %d evicted, %d expired, "
                "grew %d times", epoch + 1,
                *(result.ps[k] for k in ("ps_rows", "replicated_rows", "evictions", "expired", "grows")),
            )  # fmt: skip

    # ---- evaluation (rank 0; the others wait at the barrier) -----------------------------------
    def evaluate(self, epoch: int) -> None:
        result, history = self.result, self.result.history
        if self.world > 1:
            dist.barrier()
        if self.rank == 0:
            batches = data.in_background(self.data.test.batches(self.cfg.eval_batch_size))
            ev = result.evaluation = evaluate(self.ctx, batches)
            history.eval_steps.append(self.at.step)
            history.auc.append(ev.auc)
            history.logloss.append(ev.logloss)
            self.metrics.auc.set(ev.auc)
            self.bar.write(
                f"epoch {epoch + 1}/{self.cfg.epochs}: test AUC {ev.auc:.4f} logloss {ev.logloss:.4f}"
            )
        if self.world > 1:
            dist.barrier()

    # ---- training curve and export (rank 0) ----------------------------------------------------
    def finish(self) -> TrainResult:
        cfg, result, at = self.cfg, self.result, self.at
        self.bar.close()
        if self.cluster is not None and self.ctx.profile is not None:  # type: ignore[union-attr]
            log.info("rank %d %s", self.rank, self.ctx.profile.table())  # type: ignore[union-attr]
        result.steps, result.train_seconds = at.step, at.train_time
        result.samples_per_s = at.rows * self.world / at.train_time if at.train_time else 0.0
        result.dense_state = {k: v.detach().cpu().clone() for k, v in unwrap(self.model).state_dict().items()}
        if self.rank == 0:
            ev = result.evaluation
            if ev is None:
                raise RuntimeError("rank 0 finished training without an evaluation (no epoch ran)")
            result.auc, result.logloss = ev.auc, ev.logloss
            writer = self.writer
            curve = cfg.curve or (str(writer.staging / "eval" / "curve.svg") if writer is not None else "")
            if curve:
                result.curve = str(plot_curve(result.history, curve, title=f"{cfg.model}: {cfg.arch}"))
            if writer is not None:
                self._export(writer, ev)
        if self.world > 1:
            dist.barrier()  # the other ranks keep rank 0's shards up until the export is done
        return result

    def _export(self, writer: VersionWriter, ev: EvalResult) -> None:
        cfg, result = self.cfg, self.result
        train = model_store.TrainRecord(config=cfg.to_dict(), world_size=self.world, steps=self.at.step,
                                        plan=self.plan.to_dict() if self.plan is not None else None)  # fmt: skip
        version = writer.finish(self.cluster, unwrap(self.model).cpu(), self.model_cfg.to_dict(),
                                self.data.schema, ev, train=train,
                                test=lambda: self.data.test.batches(cfg.eval_batch_size))  # fmt: skip
        result.version_dir = str(version)
        if self.cluster is not None:  # the shards now hold the replicated tables too
            result.ps = self.cluster.stats()
        if not cfg.curve:
            result.curve = str(version / "eval" / "curve.svg")
        if cfg.publish:
            model_store.publish(cfg.store, cfg.model, writer.version)
            log.info("published %s/%s", cfg.model, writer.version)
