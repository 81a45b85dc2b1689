"""Embedding worker core: pooling, its adjoint, training steps (lookup, pool, push) against torch,
staleness."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from features.batch import FLAG_CONTEXT, FLAG_MULTI
from features.hashing import shard_of
from features.schema import schema_from_dict
from features.transform import transform
from serving.ps.optim import OptimizerSpec
from serving.ps.shard import TableShard, TableShardConfig
from serving.ps.spec import TableSpec
from serving.worker.core import (
    BatchError,
    EmbeddingWorker,
    InProcessShard,
    UpdateError,
    WorkerConfig,
)
from serving.worker.pooling import make_plan, pool, unpool_signs
from tests.helpers import wait_until
from tests.serving.helpers import DIM, SCHEMA, bags, ranking_batch, torch_pooled


def flat_batch(n: int = 6, seed: int = 0):
    """Flat records (no context: every slot per row), with labels."""
    rng = np.random.default_rng(seed)
    records = [
        {
            "user": f"u{rng.integers(3)}",
            "hist": "|".join(f"h{k}" for k in rng.integers(0, 4, rng.integers(0, 4))),
            "recent": "|".join(f"r{k}" for k in rng.integers(0, 3, rng.integers(0, 3))),
            "item": f"i{rng.integers(5)}",
            "tags": "|".join(f"t{k}" for k in rng.integers(0, 4, rng.integers(0, 4))),
            "cats": "|".join(f"c{k}" for k in rng.integers(0, 3, rng.integers(0, 3))),
            "x": float(i),
            "y": float(i % 2),
        }
        for i in range(n)
    ]
    return transform(records, SCHEMA)


def make_stores(n: int = 2, optimizer: str = "sgd", lr: float = 0.1, dim: int = DIM):
    opt = OptimizerSpec(name=optimizer, lr=lr)
    return [
        TableShard(
            TableShardConfig(
                table=TableSpec(dim=dim, capacity=10_000, optimizer=opt, init_scale=0.5),
                shard=i,
                num_shards=n,
            )
        )
        for i in range(n)
    ]


def rows_of(stores, signs, insert: bool = False) -> np.ndarray:
    """Rows of ``signs`` read straight from the owning stores (no worker involved)."""
    owner = shard_of(np.asarray(signs, np.uint64), len(stores))
    out = np.zeros((len(signs), stores[0].config.dim), np.float32)
    for k, store in enumerate(stores):
        m = owner == k
        if m.any():
            out[m] = store.lookup(np.asarray(signs, np.uint64)[m], insert=insert)[0]
    return out


def numpy_pooled(batch, schema, table: np.ndarray) -> np.ndarray:
    """The reference, by hand: a Python loop over rows and values."""
    out = np.zeros((batch.num_rows, batch.num_slots, table.shape[1]), np.float32)
    for s, feature in enumerate(schema.sparse):
        idx, offsets, rows = bags(batch, s)
        ends = list(offsets[1:]) + [len(idx)]
        for r in range(batch.num_rows):
            k = 0 if batch.flags[s] & FLAG_CONTEXT else r
            vals = [table[i] for i in idx[offsets[k] : ends[k]]]
            if vals:
                total = np.sum(vals, axis=0, dtype=np.float32)
                out[r, s] = total / len(vals) if getattr(feature, "pooling", "sum") == "mean" else total
    return out


def inserted(worker: EmbeddingWorker, batch):
    """``forward`` after a training lookup gave the batch's unseen signs their rows."""
    worker.lookup(np.asarray(batch.signs), True)
    return worker.forward(batch)


def train_step(worker: EmbeddingWorker, batch, pooled_grads: np.ndarray) -> None:
    """The trainer's step without a dense model (``training.ctx``): push the per-sign gradients of
    ``pooled_grads`` (the pooled embeddings' gradients of ``batch``)."""
    plan = make_plan(batch, SCHEMA)
    grads, used = unpool_signs(plan, np.asarray(pooled_grads, np.float32), len(batch.signs))
    worker.push(np.asarray(batch.signs)[used], grads[used])


def pooled_of(worker: EmbeddingWorker, batch) -> np.ndarray:
    """The trainer's forward: an inserting lookup, pooled."""
    return pool(make_plan(batch, SCHEMA), worker.lookup(np.asarray(batch.signs), True)[0])


@pytest.fixture
def worker():
    stores = make_stores()
    w = EmbeddingWorker([InProcessShard(s) for s in stores], SCHEMA)
    w.stores = stores
    yield w
    w.close()


# ---- forward --------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [ranking_batch, flat_batch], ids=["context", "flat"])
def test_pooling_matches_numpy(worker, make):
    batch = make()
    res = inserted(worker, batch)
    table = rows_of(worker.stores, batch.signs)
    assert res.pooled.dtype == np.float32 and res.pooled.flags.c_contiguous
    assert res.pooled.shape == (batch.num_rows, batch.num_slots, DIM)
    np.testing.assert_allclose(res.pooled, numpy_pooled(batch, SCHEMA, table), rtol=1e-6, atol=1e-7)
    assert res.version == ("", -1)


def test_context_slots_broadcast_and_empty_lists_are_zero(worker):
    batch = ranking_batch()
    assert batch.flags[0] & FLAG_CONTEXT and batch.flags[4] & FLAG_MULTI
    pooled = inserted(worker, batch).pooled
    for s in range(3):  # user, hist, recent: stored once, the same for every row
        assert (pooled[:, s] == pooled[0, s]).all()
    assert (pooled[:, 2] == 0).all()  # "recent" is an empty list
    assert (pooled[1, 4] == 0).all() and (pooled[2, 5] == 0).all()  # empty tags / cats
    assert np.abs(pooled[:, 0]).sum() > 0


def test_single_valued_fast_path_matches_numpy():
    schema = schema_from_dict({"name": "flat", "slots": [{"name": f"C{i}"} for i in range(5)]})
    records = [{f"C{i}": str((r * (i + 1)) % 3) for i in range(5)} for r in range(7)]
    batch = transform(records, schema)
    stores = make_stores(3)
    with EmbeddingWorker([InProcessShard(s) for s in stores], schema) as w:
        w.lookup(np.asarray(batch.signs), True)
        pooled = w.forward(batch).pooled
        table = rows_of(stores, batch.signs)
        np.testing.assert_array_equal(pooled, numpy_pooled(batch, schema, table))


def test_signs_are_routed_to_their_owner(worker):
    batch = flat_batch(20)
    inserted(worker, batch)
    owner = shard_of(batch.signs, 2)
    for k, store in enumerate(worker.stores):
        assert len(store) == int((owner == k).sum())


def test_forward_never_inserts(worker):
    batch = ranking_batch()
    pooled = worker.forward(batch).pooled
    assert [len(s) for s in worker.stores] == [0, 0] and (pooled == 0).all()
    inserted(worker, batch)
    rows = [len(s) for s in worker.stores]
    assert sum(rows) == len(batch.signs)
    worker.forward(ranking_batch(user="someone-new"))
    assert [len(s) for s in worker.stores] == rows


def test_bad_batches(worker):
    other = schema_from_dict({"name": "other", "slots": [{"name": "a"}]})
    with pytest.raises(BatchError, match="sparse slots"):
        worker.forward(transform([{"a": "1"}], other))
    batch = ranking_batch()
    batch.schema_hash ^= 1
    with pytest.raises(BatchError, match="schema hash"):
        worker.forward(batch)


# ---- updates --------------------------------------------------------------------------------------
class RecordingShard:
    """A shard that records updates (and can be held back or made to fail).

    ``hold=K``: a slow shard without a clock -- update ``i`` is applied only once the trainer has
    started ``i + K`` pushes (``pushes``, counted by the test under ``cond``) or the test drains
    (``draining``), so the trainer runs exactly as far ahead as the staleness bound allows."""

    def __init__(self, dim=DIM, hold=None, fail=False):
        self.dim = dim
        self.gate = threading.Event()
        self.gate.set()
        self.hold = hold
        self.draining = False
        self.fail = fail
        self.updates: list[tuple[np.ndarray, np.ndarray]] = []
        self.started = self.applied = 0
        self.lookups: list[int] = []  # in-flight batches seen by each training lookup
        self.applied_at_lookup: list[int] = []  # updates applied when each training lookup read
        self.pushes = 0
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)

    def rows(self, signs, insert, version="", timeout_s=None):
        if insert:
            with self.lock:
                self.lookups.append(self.pushes - self.applied)
                self.applied_at_lookup.append(self.applied)
        rng = np.random.default_rng(int(signs[0]) % 2**32 if len(signs) else 0)
        return rng.standard_normal((len(signs), self.dim)).astype(np.float32), ("", -1)

    def update(self, signs, grads):
        with self.cond:
            self.started += 1
            i = self.started
            if self.hold is not None:
                self.cond.wait_for(lambda: self.pushes >= i + self.hold or self.draining, timeout=10)
        self.gate.wait(10)
        if self.fail:
            raise ConnectionError("shard went away")
        with self.lock:
            self.updates.append((np.array(signs), np.array(grads)))
            self.applied += 1

    def update_lookup(self, signs, grads, lookup, timeout_s=None):
        if len(signs):
            self.update(signs, grads)
        return self.rows(lookup, True)


@pytest.mark.parametrize("make", [ranking_batch, flat_batch], ids=["context", "flat"])
def test_pushed_gradients_match_torch_autograd(make):
    shard = RecordingShard()
    batch = make()
    with EmbeddingWorker([shard], SCHEMA) as w:
        pooled = pooled_of(w, batch)
        table, _ = shard.rows(batch.signs, False)
        weight = torch.tensor(table, requires_grad=True)
        ref = torch_pooled(batch, SCHEMA, weight)
        np.testing.assert_allclose(pooled, ref.detach().numpy(), rtol=1e-6, atol=1e-7)
        grads = np.random.default_rng(1).standard_normal(pooled.shape).astype(np.float32)
        (ref * torch.from_numpy(grads)).sum().backward()
        train_step(w, batch, grads)
        w.flush()
    ((signs, sent),) = shard.updates
    expected = weight.grad.numpy()[np.searchsorted(batch.signs, signs)]
    assert len(np.unique(signs)) == len(signs) == len(batch.signs)  # every used sign once, summed
    np.testing.assert_allclose(sent, expected, rtol=1e-5, atol=1e-6)


def test_push_validates_its_gradients(worker):
    signs = np.array([1, 2], np.uint64)
    with pytest.raises(ValueError, match="finite float32 grads"):
        worker.push(signs, np.ones((2, DIM + 1), np.float32))
    with pytest.raises(ValueError, match="finite float32 grads"):
        worker.push(signs, np.full((2, DIM), np.nan, np.float32))
    assert worker.in_flight == 0
    worker.push(signs, np.zeros((2, DIM), np.float32))  # still accepted after the refusals
    worker.flush()
    assert worker.in_flight == 0


def test_background_failure_is_raised_by_the_next_call():
    shard = RecordingShard(fail=True)
    signs, grads = np.array([1], np.uint64), np.ones((1, DIM), np.float32)
    with EmbeddingWorker([shard], SCHEMA, WorkerConfig(staleness=4)) as w:
        w.push(signs, grads)
        with pytest.raises(UpdateError, match="shard went away"):
            w.flush()
        w.flush()  # reported once
        w.push(signs, grads)
        wait_until(lambda: w.in_flight == 0, 10, "the failed update done")  # its error is kept first
        with pytest.raises(UpdateError):
            w.lookup(signs, True)


def test_push_returns_before_the_update_is_applied():
    shard = RecordingShard()
    shard.gate.clear()
    signs = np.asarray(ranking_batch().signs)
    with EmbeddingWorker([shard], SCHEMA, WorkerConfig(staleness=1)) as w:
        w.push(signs, np.ones((len(signs), DIM), np.float32))  # returns although the shard is blocked
        assert shard.applied == 0 and w.in_flight == 1
        w.lookup(signs, True)  # K=1: one update in flight is allowed
        shard.gate.set()
        w.flush()
        assert shard.applied == 1 and w.in_flight == 0


@pytest.mark.parametrize("staleness", [0, 2])
def test_staleness_bound(staleness):
    shard = RecordingShard(hold=staleness)
    config = WorkerConfig(staleness=staleness, update_threads=1)
    batch = ranking_batch()
    with EmbeddingWorker([shard], SCHEMA, config) as w:
        for _ in range(8):
            pooled = pooled_of(w, batch)
            with shard.cond:
                shard.pushes += 1
                shard.cond.notify_all()
            train_step(w, batch, np.ones_like(pooled))
        with shard.cond:
            shard.draining = True
            shard.cond.notify_all()
        w.flush()
        assert shard.applied == 8 and w.in_flight == 0
    assert max(shard.lookups) == staleness  # never more than K in flight at a training lookup
    assert shard.lookups[0] == 0


# ---- an update with the next lookup: one call per shard ----------------------------------------------
def test_push_lookup_reads_rows_after_its_update(worker):
    """The rows come from each owning shard after the update landed there (SGD, lr 0.1); new
    signs are inserted; the call counts in flight until done."""
    signs = np.array([5, 6, 7, 8], np.uint64)
    before = rows_of(worker.stores, signs, insert=True)
    lookup = np.array([8, 6, 99], np.uint64)
    rows = worker.push_lookup(signs[:2], np.ones((2, DIM), np.float32), lookup).result(10)
    worker.flush()
    assert worker.in_flight == 0
    np.testing.assert_allclose(
        rows_of(worker.stores, signs), before - 0.1 * (np.arange(4) < 2)[:, None], rtol=1e-6
    )
    np.testing.assert_array_equal(rows, rows_of(worker.stores, lookup))
    assert rows_of(worker.stores, lookup[2:]).any()  # 99 was inserted (a random row)


def test_push_lookup_reads_after_older_updates_within_the_bound():
    """Staleness 0: the lookup waits for an older plain push still held by the shard; its own
    (empty) update does not let it jump the queue."""
    shard = RecordingShard()
    shard.gate.clear()
    with EmbeddingWorker([shard], SCHEMA, WorkerConfig(staleness=0)) as w:
        w.push(np.array([1], np.uint64), np.ones((1, DIM), np.float32))
        rows = w.push_lookup(np.empty(0, np.uint64), np.empty((0, DIM), np.float32), np.array([3], np.uint64))
        assert w.in_flight == 2
        shard.gate.set()
        assert rows.result(10).shape == (1, DIM)
        w.flush()
    assert shard.applied_at_lookup == [1]


def test_push_lookup_failure_fails_its_rows_and_the_next_call():
    shard = RecordingShard(fail=True)
    with EmbeddingWorker([shard], SCHEMA, WorkerConfig(staleness=2)) as w:
        rows = w.push_lookup(
            np.array([1], np.uint64), np.ones((1, DIM), np.float32), np.array([2], np.uint64)
        )
        with pytest.raises(UpdateError, match="shard went away") as e:
            rows.result(10)
        assert isinstance(e.value.__cause__, ConnectionError)
        with pytest.raises(UpdateError, match="shard went away"):
            w.flush()
        with pytest.raises(ValueError, match="finite float32 grads"):
            w.push_lookup(
                np.array([1], np.uint64), np.full((1, DIM), np.nan, np.float32), np.array([2], np.uint64)
            )


# ---- one training step against torch ----------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_training_steps_match_torch(optimizer):
    stores = make_stores(2, optimizer=optimizer, lr=0.05)
    batches = [flat_batch(8, seed=1), flat_batch(8, seed=2)]
    all_signs = np.unique(np.concatenate([b.signs for b in batches]))
    rng = np.random.default_rng(0)
    head = torch.from_numpy(rng.standard_normal((len(SCHEMA.sparse), DIM)).astype(np.float32))

    def loss_of(pooled: torch.Tensor, labels: np.ndarray) -> torch.Tensor:
        logits = (pooled * head).sum(dim=(1, 2))
        return torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.from_numpy(labels))

    with EmbeddingWorker([InProcessShard(s) for s in stores], SCHEMA) as w:
        rows0 = rows_of(stores, all_signs, insert=True)  # torch starts from the same rows
        emb = torch.nn.Embedding(len(all_signs), DIM)
        emb.weight.data = torch.from_numpy(rows0.copy())
        opt_cls = torch.optim.SGD if optimizer == "sgd" else torch.optim.Adagrad
        opt = opt_cls(emb.parameters(), lr=0.05)
        for b in batches:
            pooled = torch.tensor(pooled_of(w, b), requires_grad=True)
            loss_of(pooled, b.labels).backward()
            train_step(w, b, pooled.grad.numpy())

            # torch: the same model, embeddings in-process
            opt.zero_grad()
            local = torch.from_numpy(np.searchsorted(all_signs, b.signs))
            ref = torch_pooled(b, SCHEMA, emb.weight[local])
            np.testing.assert_allclose(pooled.detach().numpy(), ref.detach().numpy(), atol=1e-6)
            loss_of(ref, b.labels).backward()
            opt.step()
        w.flush()
        np.testing.assert_allclose(rows_of(stores, all_signs), emb.weight.detach().numpy(), atol=1e-6)
        assert not np.allclose(rows0, emb.weight.detach().numpy())  # the rows moved
