"""The training step's PS traffic with prefetch: after an epoch's first step, one UpdateLookup
per shard per step, carrying that step's gradients and the batch after next's signs; the rows a
step trains on hold every update but the previous step's (the staleness the worker is told)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from features import stream
from features.hashing import shard_of
from features.schema import load_schema
from serving.ps.shard import OptimizerSpec, TableShard, TableShardConfig
from serving.ps.spec import TableSpec
from serving.worker.core import EmbeddingWorker, InProcessShard, WorkerConfig
from training import data
from training.ctx import TrainCtx
from training.models import ModelConfig, build_model

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "data/schemas/criteo.yaml"
TRAIN = ROOT / "data/criteo/wide_resdnn_criteo_train.tsv"
DIM = 8


class CountingShard(InProcessShard):
    """A real in-process store as a shard that records each call: its kind, the signs it read
    and how many updates the shard had applied before it read them."""

    def __init__(self, store: TableShard):
        super().__init__(store)
        self.calls: list[tuple[str, np.ndarray, int]] = []
        self.applied = 0
        self.lock = threading.Lock()

    def _record(self, kind: str, signs: np.ndarray) -> None:
        with self.lock:
            self.calls.append((kind, np.array(signs), self.applied))

    def _apply(self, signs: np.ndarray, grads: np.ndarray) -> None:
        if len(signs):
            self.store.apply_gradients(signs, grads)
            with self.lock:
                self.applied += 1

    def rows(self, signs, insert, version="", timeout_s=None):
        self._record("rows", signs)
        return super().rows(signs, insert, version, timeout_s)

    def update(self, signs, grads):
        self._record("update", signs)
        self._apply(signs, grads)

    def update_lookup(self, signs, grads, lookup, timeout_s=None):
        self._apply(signs, grads)
        self._record("update_lookup", lookup)
        return super().rows(lookup, True)


@pytest.mark.parametrize("flush_after", [None, 2], ids=["epoch", "flush-mid-epoch"])
def test_prefetch_sends_one_update_lookup_per_shard_per_step(flush_after):
    """Six batches, two shards, K = 1 (the worker is told 0). Each shard gets the first two
    batches' lookups, then one update_lookup per step whose lookup is the batch after next's signs
    it owns, read after every earlier step's update and its own (the last one perhaps after step 4's
    too, pushed while it was on its way); the last two steps only update.
    A flush in the middle (a checkpoint) waits for the rows on their way and keeps them."""
    schema = load_schema(SCHEMA)
    batches = data.batches(data.take(stream.read(TRAIN, schema, limit=192), slice(0, 192)), schema, 32)
    assert len(batches) == 6
    opt = OptimizerSpec("adagrad", lr=0.05)
    shards = [
        CountingShard(
            TableShard(
                TableShardConfig(
                    table=TableSpec(dim=DIM, capacity=10_000, optimizer=opt), shard=i, num_shards=2
                )
            )
        )
        for i in range(2)
    ]
    worker = EmbeddingWorker(shards, schema, WorkerConfig(staleness=0))
    cfg = ModelConfig(kind="dlrm", num_slots=len(schema.sparse), dim=DIM, num_dense=len(schema.dense),
                      bottom_mlp=[16, DIM])  # fmt: skip
    torch.manual_seed(0)
    model = build_model(cfg)
    ctx = TrainCtx(worker, model, torch.optim.Adam(model.parameters(), lr=1e-3), schema, prefetch=True)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    try:
        for step, batch in enumerate(ctx.steps(batches)):
            logits = ctx.forward(batch)
            ctx.backward(loss_fn(logits, torch.from_numpy(batch.labels)))
            if step == flush_after:
                ctx.flush()
        ctx.flush()
    finally:
        ctx.close()
        worker.close()

    for i, shard in enumerate(shards):
        mine = [b.signs[shard_of(b.signs, 2) == i] for b in batches]
        kinds = [kind for kind, _, _ in shard.calls]
        assert kinds.count("rows") == 2, kinds
        assert kinds.count("update_lookup") == 4 and kinds.count("update") == 2, kinds
        assert shard.applied == 6
        read = [
            t
            for kind, signs, _ in shard.calls
            if kind == "rows"
            for t, m in enumerate(mine)
            if np.array_equal(signs, m)
        ]
        assert sorted(read) == [0, 1]
        exchanges = [(signs, applied) for kind, signs, applied in shard.calls if kind == "update_lookup"]
        for t, (signs, applied) in enumerate(exchanges):
            np.testing.assert_array_equal(signs, mine[t + 2])  # step t's call looks up batch t + 2
            # after steps 0..t's updates, its own the last. The last exchange may also see step 4's
            # plain update: a push runs on an update thread, beside an exchange still on its way
            # (fresher rows, never staler); earlier ones cannot, step 4 needs step 2's rows first
            late = {t + 1, t + 2} if t == len(exchanges) - 1 else {t + 1}
            assert applied in late, (t, applied)


def test_a_plan_that_replicates_every_table_never_asks_the_ps():
    """Every table replicated: the step trains from the trainer's own store and sends the PS no
    lookup and no update (what the planner's estimate of that plan assumes: no round trips)."""
    from training.config import TrainConfig
    from training.replicated import Replicated

    schema = load_schema(SCHEMA)
    batches = data.batches(data.take(stream.read(TRAIN, schema, limit=128), slice(0, 128)), schema, 32)
    opt = OptimizerSpec("adagrad", lr=0.05)
    shard = CountingShard(TableShard(TableShardConfig(table=TableSpec(dim=16, capacity=1000, optimizer=opt))))
    worker = EmbeddingWorker([shard], schema, WorkerConfig(staleness=0))
    replicated = Replicated(TrainConfig().store_config(schema.fingerprint), 4096)
    cfg = ModelConfig(kind="dlrm", num_slots=len(schema.sparse), dim=16, num_dense=len(schema.dense),
                      bottom_mlp=[16, 16])  # fmt: skip
    model = build_model(cfg)
    local = np.ones(len(schema.sparse), bool)
    ctx = TrainCtx(worker, model, torch.optim.Adam(model.parameters()), schema, True, replicated, local)
    try:
        for batch in ctx.steps(batches):
            logits = ctx.forward(batch)
            ctx.backward(torch.nn.BCEWithLogitsLoss()(logits, torch.from_numpy(batch.labels)))
        ctx.flush()
    finally:
        ctx.close()
        worker.close()
    assert shard.calls == [] and shard.applied == 0
    signs = np.unique(np.concatenate([b.signs for b in batches]))
    assert len(replicated) == len(signs)  # every sign trained in process


def test_reading_ahead_raises_a_data_error_after_the_batches_before_it():
    """``steps`` reads two batches ahead, yet a reader's error comes where it happened: after
    every batch read before it has been handed out (a caller counting batches loses none)."""

    def batches():
        yield from ("b0", "b1", "b2", "b3")
        raise ValueError("line 5 is not a record")

    ctx = TrainCtx(
        worker=None, dense_model=torch.nn.Linear(1, 1), dense_optimizer=None, schema=load_schema(SCHEMA)
    )
    got = []
    with pytest.raises(ValueError, match="line 5"):
        for b in ctx.steps(batches()):  # type: ignore[arg-type]
            got.append((b, ctx._upcoming))
    assert got == [("b0", ("b1", "b2")), ("b1", ("b2", "b3")), ("b2", ("b3", None)), ("b3", (None, None))]
