"""The hybrid training step behind two verbs (PERSIA's ``persia/ctx.py``):

    logits = ctx.forward(batch)        # embedding worker lookup + dense forward
    ctx.backward(loss)                 # dense backward + step (DDP all-reduce), sparse grads -> worker

The embedding worker owns the sparse half: ``forward(mode="train")`` pools rows (inserting unseen
signs) and remembers the batch; ``backward(batch_id, pooled_grads)`` returns at once and the
worker scatters the gradients to the PS shards in the background, with at most K batches'
updates in flight (the staleness bound). The dense half is plain torch: the pooled embeddings
enter the network as a leaf tensor, so after ``loss.backward()`` its ``.grad`` is exactly the
gradient the worker needs.

Prefetch (``prefetch=True``, only meaningful with K >= 1): iterate the epoch through
``ctx.steps(batches)`` and each ``forward`` starts the next batch's lookup on a background thread,
so it overlaps this step's dense forward/backward. That lookup runs before this step's sparse
update is sent, i.e. it is one batch staler; give the worker staleness K-1 to keep the bound K
(``train.py`` does).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from features.batch import CompactBatch
from features.schema import Schema
from features.transform import dense_matrix


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


def _tensor(a: np.ndarray, device: torch.device) -> Tensor:
    # arrays decoded from a gRPC payload are read-only views; torch wants writable memory
    if not a.flags.writeable:
        a = a.copy()
    return torch.from_numpy(a).to(device)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel wrapper."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


class TrainCtx:
    """One hybrid step: sparse rows through an EmbeddingWorker, dense network in torch."""

    def __init__(
        self,
        worker,
        dense_model: nn.Module,
        dense_optimizer: DenseOptimizer,
        schema: Schema,
        prefetch: bool = False,
    ):
        self.worker = worker
        self.model = dense_model  # possibly DDP-wrapped: its backward all-reduces dense grads
        self.optimizer = dense_optimizer
        self.schema = schema
        self.device = next(unwrap(dense_model).parameters()).device
        self._pending: tuple[int, Tensor] | None = None
        self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="prefetch") if prefetch else None
        self._upcoming: CompactBatch | None = None  # the batch after the current one (steps())
        self._prefetched: tuple[CompactBatch, Future] | None = None

    def steps(self, batches: Iterable[CompactBatch]) -> Iterator[CompactBatch]:
        """The batches in order, telling ``forward`` which one comes next (for prefetch)."""
        it = iter(batches)
        current = next(it, None)
        try:
            while current is not None:
                self._upcoming = next(it, None)
                yield current
                current = self._upcoming
        finally:
            self._upcoming = None

    def _lookup(self, batch: CompactBatch):
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched[0] is batch:
            result = prefetched[1].result()
        else:
            if prefetched is not None:  # not the batch we guessed: let that lookup finish, unused
                prefetched[1].result()
            result = self.worker.forward(batch, mode="train")
        if self._prefetcher is not None and self._upcoming is not None:
            upcoming = self._upcoming
            self._prefetched = (upcoming, self._prefetcher.submit(self.worker.forward, upcoming, "train"))
        return result

    def forward(self, batch: CompactBatch) -> Tensor:
        """Logits (B,) of a training batch; the next call must be ``backward``."""
        if self._pending is not None:
            raise RuntimeError("forward called twice without backward")
        result = self._lookup(batch)
        pooled = _tensor(result.pooled, self.device).requires_grad_()
        dense = _tensor(dense_matrix(batch, self.schema), self.device)
        self._pending = (result.batch_id, pooled)
        return self.model(pooled, dense)

    def backward(self, loss: Tensor) -> None:
        """Gradients of ``loss``: sparse ones to the worker (async), dense ones applied here."""
        if self._pending is None:
            raise RuntimeError("backward called without a forward")
        batch_id, pooled = self._pending
        self._pending = None
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if pooled.grad is None:
            raise RuntimeError("the loss does not depend on the pooled embeddings of the last forward")
        # sparse first: the worker applies them while the dense optimizer steps
        self.worker.backward(batch_id, pooled.grad.detach().cpu().numpy())
        self.optimizer.step()

    @torch.inference_mode()
    def predict(self, batch: CompactBatch) -> Prediction:
        """Logits of a batch with the current rows (never inserts) and the dense net in eval mode."""
        model = unwrap(self.model)  # no DDP collectives: evaluation may run on one rank only
        was_training = model.training
        model.eval()
        try:
            pooled = np.ascontiguousarray(self.worker.forward(batch, mode="infer").pooled, np.float32)
            dense = dense_matrix(batch, self.schema)
            logits = model(_tensor(pooled, self.device), _tensor(dense, self.device)).cpu().numpy()
        finally:
            model.train(was_training)
        return Prediction(logits, pooled, dense)

    def flush(self) -> None:
        """Wait until every sparse update sent so far is applied on the PS."""
        if self._prefetched is not None:  # an epoch ended early: that lookup is never trained
            self._prefetched[1].result()
            self._prefetched = None
        self.worker.flush()

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
