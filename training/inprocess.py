"""The no-PS baseline: embedding tables as one torch ``nn.EmbeddingBag`` inside the trainer.

Same verbs as ``TrainCtx`` (``forward`` / ``backward`` / ``predict`` / ``flush``), so the training
loop and the benchmark run it unchanged. Signs map to table rows without a Python dict: the
vocabulary is the sorted unique signs of the training batches and a row is found with
``np.searchsorted``; a sign outside it maps to row 0, the padding row, which is zero and never
trained (as the PS answers an unseen sign in inference with a zero row). Updates are
synchronous, in the trainer (sparse gradients, the ``torch.optim`` class that the PS optimizer's
registry entry names, e.g. Adagrad), i.e. what the PS path is measured against.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from torch import Tensor, nn

from features.batch import FLAG_CONTEXT, FLAG_MULTI, CompactBatch
from features.hashing import unique_signs
from features.schema import Schema
from features.transform import dense_matrix
from serving.ps import optim
from training.ctx import Prediction, device_of, on_device, unwrap


class SignTable(nn.Module):
    """Pooled (B, S, D) embeddings of a CompactBatch from one EmbeddingBag over a fixed vocabulary."""

    def __init__(self, vocab: np.ndarray, schema: Schema, dim: int, init_scale: float, seed: int):
        super().__init__()
        self.vocab = unique_signs(vocab)
        self.mean_slot = np.array([getattr(f, "pooling", "sum") == "mean" for f in schema.sparse])
        self.bag = nn.EmbeddingBag(len(self.vocab) + 1, dim, mode="sum", sparse=True, padding_idx=0)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.bag.weight.uniform_(-init_scale, init_scale, generator=gen)
            self.bag.weight[0] = 0.0

    @classmethod
    def from_batches(
        cls, batches: Iterable[CompactBatch], schema: Schema, dim: int, init_scale: float, seed: int
    ):
        return cls(np.concatenate([b.signs for b in batches]), schema, dim, init_scale, seed)

    def rows(self, signs: np.ndarray) -> np.ndarray:
        """Table row of each sign (0 where the sign is not in the vocabulary)."""
        pos = np.minimum(np.searchsorted(self.vocab, signs), len(self.vocab) - 1)
        return np.where(self.vocab[pos] == signs, pos + 1, 0)

    def bags(self, batch: CompactBatch) -> tuple[Tensor, Tensor, Tensor | None]:
        """EmbeddingBag input, offsets and per-value weights, bags in (slot, row) order."""
        rows = self.rows(batch.signs)[batch.global_values()]
        vsplit = batch.value_splits
        n = batch.num_rows
        idx, lengths, weights = [], [], []
        for s in range(batch.num_slots):
            vals = rows[vsplit[s] : vsplit[s + 1]]
            flags = int(batch.flags[s])
            if flags & FLAG_MULTI:
                offsets = batch.slot(s).offsets
                if offsets is None:
                    raise ValueError(f"slot {s} is flagged multi-valued but has no offsets")
                off = offsets.astype(np.int64)
                lens = np.diff(off)
            else:
                lens = np.ones(len(vals), np.int64)
            if flags & FLAG_CONTEXT:  # one stored row: every row of the batch gets the same bag
                vals, lens = np.tile(vals, n), np.repeat(lens, n)
            idx.append(vals)
            lengths.append(lens)
            weights.append(
                np.repeat(1.0 / np.maximum(lens, 1), lens) if self.mean_slot[s] else np.ones(len(vals))
            )
        lengths_all = np.concatenate(lengths)
        offsets = np.concatenate(([0], np.cumsum(lengths_all)[:-1]))
        w = torch.from_numpy(np.concatenate(weights).astype(np.float32)) if self.mean_slot.any() else None
        return torch.from_numpy(np.concatenate(idx).astype(np.int64)), torch.from_numpy(offsets), w

    def forward(self, batch: CompactBatch) -> Tensor:
        device = self.bag.weight.device  # the dense network's: the table moves with it
        idx, offsets, w = (t.to(device) if t is not None else None for t in self.bags(batch))
        pooled = self.bag(idx, offsets, per_sample_weights=w)  # (S * B, D), slot-major
        return pooled.view(batch.num_slots, batch.num_rows, -1).transpose(0, 1)


def sparse_optimizer(spec: optim.OptimizerSpec, params) -> torch.optim.Optimizer:
    """The torch counterpart of the PS optimizer ``spec`` (sparse gradients) with its
    hyper-parameters, from the registry."""
    sparse = optim.get(spec.name)
    if sparse.torch is None:
        raise ValueError(f"the in-process baseline has no sparse {spec.name!r} optimizer (torch has none)")
    return getattr(torch.optim, sparse.torch)(params, **sparse.torch_args(spec))


class InProcessCtx:
    """``TrainCtx``'s verbs over a ``SignTable`` in the trainer (no PS, no worker), on the dense
    network's device (where the table must be too)."""

    def __init__(self, table: SignTable, dense_model: nn.Module, dense_optimizer, sparse_opt, schema: Schema):
        self.device = device_of(dense_model)
        if table.bag.weight.device != self.device:
            raise ValueError(f"the table is on {table.bag.weight.device}, the dense network on {self.device}")
        self.table = table
        self.model = dense_model
        self.optimizer = dense_optimizer
        self.sparse_optimizer = sparse_opt
        self.schema = schema

    def forward(self, batch: CompactBatch) -> Tensor:
        return self.model(self.table(batch), on_device(dense_matrix(batch, self.schema), self.device))

    def backward(self, loss: Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.sparse_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.sparse_optimizer.step()
        self.optimizer.step()

    @torch.inference_mode()
    def predict(self, batch: CompactBatch) -> Prediction:
        model = unwrap(self.model)
        was_training = model.training
        model.eval()
        try:
            pooled = self.table(batch)
            dense = dense_matrix(batch, self.schema)
            logits = model(pooled, on_device(dense, self.device))
        finally:
            model.train(was_training)
        return Prediction(logits.cpu().numpy(), pooled.contiguous().cpu().numpy(), dense)

    def steps(self, batches: Iterable[CompactBatch]) -> Iterable[CompactBatch]:
        return batches

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass
