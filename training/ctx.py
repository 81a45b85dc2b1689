"""The hybrid training step behind two verbs (PERSIA's ``persia/ctx.py``):

    logits = ctx.forward(batch)        # rows of the batch's signs, pooled + dense forward
    ctx.backward(loss)                 # dense backward + step (DDP all-reduce), sparse grads out

Each embedding table (a sparse slot) lives where the sharding plan (``training.planning.plan``) put it:
``ps`` tables on the PS shards, looked up through the embedding worker (``lookup``, inserting
unseen signs) and updated in the background (``push`` returns at once; at most K updates in
flight, the staleness bound); ``replicated`` tables in the trainer (``training.replicated``),
updated synchronously. The step pools the rows itself (the worker's ``pool`` and its compiled
adjoint ``unpool_signs``). The dense half is plain torch: the pooled embeddings enter the network
as a leaf tensor, so after ``loss.backward()`` its ``.grad`` gives every sign's gradient.

Prefetch (``prefetch=True``, only meaningful with K >= 1): iterate the epoch through
``ctx.steps(batches)``, which tells the step the two batches after the current one. Each
``backward`` sends its PS gradients together with the lookup of the batch after next, one
``UpdateLookup`` round trip per shard per step (``EmbeddingWorker.push_lookup``); the rows arrive
while the next step runs, so the PS's work overlaps the dense network's. The first step of an
epoch looks up its own batch and the next one (on a background thread). Rows so read may miss the
update of the step in between, i.e. they are up to one batch staler than the worker counts; give
the worker staleness K-1 to keep the bound K (``train.py`` does).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from features.batch import CompactBatch
from features.schema import Schema
from features.transform import dense_matrix
from serving.worker.pooling import PoolingPlan, make_plan, pool, unpool_signs

if TYPE_CHECKING:
    from serving.worker.core import EmbeddingWorker
    from training.replicated import Replicated


class DenseOptimizer(Protocol):
    """What TrainCtx uses of its dense optimizer (a ``torch.optim.Optimizer``, or a no-op one for a
    frozen network)."""

    def zero_grad(self, set_to_none: bool = True) -> None: ...

    def step(self) -> object: ...


class Prediction(NamedTuple):
    """Evaluation output of one batch: logits plus the exact dense-network inputs (for export
    verification)."""

    logits: np.ndarray  # (B,) float32
    pooled: np.ndarray  # (B, S, D) float32
    dense: np.ndarray  # (B, F) float32


class _Step(NamedTuple):
    """What ``backward`` needs of its ``forward``."""

    signs: np.ndarray
    on_replicated: np.ndarray | None  # bool per sign: replicated table (None: none is)
    plan: PoolingPlan
    pooled: Tensor  # the leaf whose .grad the loss fills
    dense_from: float  # perf_counter when the dense forward began (--profile)


def on_device(a: np.ndarray, device: torch.device) -> Tensor:
    """``a`` as a tensor on ``device``."""
    # arrays decoded from a gRPC payload are read-only views; torch wants writable memory
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a).to(device)


def device_of(model: nn.Module) -> torch.device:
    """Where the (possibly DDP-wrapped) network's parameters are: its inputs go there too."""
    return next(unwrap(model).parameters()).device


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel wrapper."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


class Profile:
    """Seconds per phase of the training step, summed (``--profile``): ``pull`` the PS rows (a
    prefetched lookup's wait; the staleness wait is in it), ``replicated`` the replicated tables'
    lookup and update, ``pool`` the pooling and its adjoint, ``dense`` forward, backward and
    optimizer, ``push`` queueing the PS updates."""

    PHASES = ("pull", "replicated", "pool", "dense", "push")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0

    def add(self, phase: str, t0: float) -> float:
        now = time.perf_counter()
        self.seconds[phase] += now - t0
        return now

    def table(self) -> str:
        n = max(self.steps, 1)
        total = sum(self.seconds.values())
        cells = "  ".join(f"{k} {v / n * 1e3:.3f}" for k, v in self.seconds.items())
        return f"step profile, ms per step over {self.steps} steps: {cells}  (sum {total / n * 1e3:.3f})"


class TrainCtx:
    """One hybrid step: each table's rows in the trainer (``replicated``, the sharding plan's
    replicated slots, updated synchronously) or on the PS through an EmbeddingWorker (updated
    asynchronously, at most K updates in flight); the dense network in torch."""

    def __init__(
        self,
        worker: EmbeddingWorker,
        dense_model: nn.Module,
        dense_optimizer: DenseOptimizer,
        schema: Schema,
        prefetch: bool = False,
        replicated: Replicated | None = None,
        replicated_mask: np.ndarray | None = None,
        profile: Profile | None = None,
    ):
        self.worker = worker
        self.model = dense_model  # possibly DDP-wrapped: its backward all-reduces dense grads
        self.optimizer = dense_optimizer
        self.schema = schema
        self.device = device_of(dense_model)
        self.replicated_mask = (
            np.zeros(len(schema.sparse), bool)
            if replicated_mask is None
            else np.asarray(replicated_mask, bool)
        )
        if self.replicated_mask.any() and replicated is None:
            raise ValueError("the plan replicates tables but no replicated store was given")
        self.replicated = replicated if self.replicated_mask.any() else None
        self.all_replicated = bool(
            self.replicated_mask.all()
        )  # every table replicated: the PS is never asked
        self.profile = profile
        self._pending: _Step | None = None
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="prefetch") if prefetch else None
        self._upcoming: tuple[CompactBatch | None, CompactBatch | None] = (None, None)
        """The two batches after the current one (``steps``)."""
        # PS rows on their way, oldest first: a prefetch (None: no PS signs) or a push_lookup's
        self._ahead: list[tuple[CompactBatch, Future[np.ndarray | None] | Future[np.ndarray]]] = []

    def steps(self, batches: Iterable[CompactBatch]) -> Iterator[CompactBatch]:
        """The batches in order, telling the step the two that come next (for prefetch). Reading
        ahead moves no error: one the batches raise comes after the batches read before it."""
        it = iter(batches)
        window: list[CompactBatch] = []
        failed: Exception | None = None

        def read(n: int) -> None:
            nonlocal failed
            if failed is None:
                try:
                    window.extend(itertools.islice(it, n))
                except Exception as e:
                    failed = e

        read(3)
        try:
            while window:
                self._upcoming = (
                    window[1] if len(window) > 1 else None,
                    window[2] if len(window) > 2 else None,
                )
                yield window.pop(0)
                read(1)
        finally:
            self._upcoming = (None, None)
        if failed is not None:
            raise failed

    def upcoming(self, after: Sequence[CompactBatch]) -> None:
        """The batches of the next steps, for a caller that steps without ``steps`` (a stream's
        looks read ahead): their rows are looked up during this one."""
        self._upcoming = (after[0] if after else None, after[1] if len(after) > 1 else None)

    def _on_replicated(self, batch: CompactBatch) -> np.ndarray:
        """bool per sign of the batch: its table is replicated."""
        return np.repeat(self.replicated_mask, np.asarray(batch.sign_counts, np.int64))

    def _remote_signs(self, batch: CompactBatch) -> np.ndarray:
        """The batch's signs whose tables are on the PS."""
        return batch.signs if self.replicated is None else batch.signs[~self._on_replicated(batch)]

    def _pull(self, signs: np.ndarray) -> np.ndarray | None:
        return self.worker.lookup(signs, True)[0] if len(signs) else None

    def _remote_rows(self, batch: CompactBatch) -> np.ndarray | None:
        """Training rows of the batch's PS tables: looked up ahead, or now."""
        ahead, self._ahead = self._ahead, []
        if ahead and ahead[0][0] is batch:
            rows, self._ahead = ahead[0][1].result(), ahead[1:]
        else:
            for _, rows_coming in ahead:  # not the batches we were told: let those calls finish, unused
                rows_coming.result()
            rows = self._pull(self._remote_signs(batch))
        upcoming = self._upcoming[0]
        if (
            self._prefetcher is not None
            and upcoming is not None
            and all(b is not upcoming for b, _ in self._ahead)
        ):
            # the next batch's rows are not on their way (an epoch's first step): fetch them now
            self._ahead.append((upcoming, self._prefetcher.submit(self._pull, self._remote_signs(upcoming))))
        return rows

    def _table(self, batch: CompactBatch, on_replicated: np.ndarray | None, train: bool) -> np.ndarray:
        """Rows of the batch's signs in ``batch.signs`` order, each from where its table lives."""
        prof, t0 = self.profile, time.perf_counter()
        if on_replicated is None:  # every table on the PS
            rows = self._remote_rows(batch) if train else self.worker.lookup(batch.signs, False)[0]
            if prof is not None:
                prof.add("pull", t0)
            return rows if rows is not None else np.empty((0, self.worker.dim), np.float32)
        assert self.replicated is not None
        if self.all_replicated:  # no PS rows to merge: the store's answer is the table
            table = self.replicated.rows(batch.signs, train)
            if prof is not None:
                prof.add("replicated", t0)
            return table
        table = np.empty((len(batch.signs), self.worker.dim), np.float32)
        remote = ~on_replicated
        if train:
            rows = self._remote_rows(batch)
        else:
            rows = self.worker.lookup(batch.signs[remote], False)[0] if remote.any() else None
        if rows is not None:
            table[remote] = rows
        if prof is not None:
            t0 = prof.add("pull", t0)
        table[on_replicated] = self.replicated.rows(batch.signs[on_replicated], train)
        if prof is not None:
            prof.add("replicated", t0)
        return table

    def forward(self, batch: CompactBatch) -> Tensor:
        """Logits (B,) of a training batch; the next call must be ``backward``."""
        if self._pending is not None:
            raise RuntimeError("forward called twice without backward")
        prof, t0 = self.profile, time.perf_counter()
        plan = make_plan(batch, self.schema)
        on_replicated = self._on_replicated(batch) if self.replicated is not None else None
        if prof is not None:
            prof.add("pool", t0)
        table = self._table(batch, on_replicated, train=True)
        t0 = time.perf_counter()
        pooled_np = pool(plan, table)
        if prof is not None:
            t0 = prof.add("pool", t0)
        pooled = on_device(pooled_np, self.device).requires_grad_()
        dense = on_device(dense_matrix(batch, self.schema), self.device)
        self._pending = _Step(batch.signs, on_replicated, plan, pooled, t0)
        logits: Tensor = self.model(pooled, dense)  # nn.Module.__call__ is typed as returning Any
        return logits

    def backward(self, loss: Tensor) -> None:
        """Gradients of ``loss``: the PS tables' to the worker (async), the replicated tables' and
        the dense network's applied here."""
        if self._pending is None:
            raise RuntimeError("backward called without a forward")
        step, self._pending = self._pending, None
        prof = self.profile
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # torch leaves Tensor.backward unannotated
        grad = step.pooled.grad
        if grad is None:
            raise RuntimeError("the loss does not depend on the pooled embeddings of the last forward")
        t0 = time.perf_counter()
        sign_grads, used = unpool_signs(step.plan, grad.detach().cpu().numpy(), len(step.signs))
        if prof is not None:
            prof.seconds["dense"] += t0 - step.dense_from
            t0 = prof.add("pool", t0)
        # the PS's first: the worker applies them while this thread does the rest
        remote = used if step.on_replicated is None else used & ~step.on_replicated
        after_next = self._upcoming[1] if self._prefetcher is not None and not self.all_replicated else None
        lookup = self._remote_signs(after_next) if after_next is not None else None
        if after_next is not None and lookup is not None and len(lookup):
            # with the lookup of the batch after next: one round trip per shard
            rows = self.worker.push_lookup(step.signs[remote], sign_grads[remote], lookup)
            self._ahead.append((after_next, rows))
        elif remote.any():
            self.worker.push(step.signs[remote], sign_grads[remote])
        if prof is not None:
            t0 = prof.add("push", t0)
        if self.replicated is not None and step.on_replicated is not None:
            mine = used if self.all_replicated else used & step.on_replicated
            self.replicated.update(step.signs[mine], sign_grads[mine])
            if prof is not None:
                t0 = prof.add("replicated", t0)
        self.optimizer.step()
        if prof is not None:
            prof.add("dense", t0)
            prof.steps += 1

    @torch.no_grad()  # not inference_mode: a follower's frozen TorchScript network saves its inputs
    def predict(self, batch: CompactBatch) -> Prediction:
        """Logits of a batch with the current rows (never inserts) and the dense net in eval mode."""
        model = unwrap(self.model)  # no DDP collectives: evaluation may run on one rank only
        was_training = model.training
        model.eval()
        try:
            on_replicated = self._on_replicated(batch) if self.replicated is not None else None
            table = self._table(batch, on_replicated, train=False)
            pooled = np.ascontiguousarray(pool(make_plan(batch, self.schema), table), np.float32)
            dense = dense_matrix(batch, self.schema)
            logits = model(on_device(pooled, self.device), on_device(dense, self.device)).cpu().numpy()
        finally:
            model.train(was_training)
        return Prediction(logits, pooled, dense)

    def flush(self) -> None:
        """Wait until every sparse update sent so far is applied on the PS. Rows looked up ahead
        are kept for their steps (they miss no more updates than when they were read)."""
        for _, rows in self._ahead:  # their calls carry updates too
            rows.exception()  # waits; a failure is raised by the worker's flush
        self.worker.flush()

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
