"""No silent loss: a full PS store without an eviction policy grows and keeps every row exactly as
a store that never filled up would; past its memory limit it fails loudly and keeps what it has;
rows go only when an eviction policy or a TTL is configured, and every one is counted."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import serving.ps.arrays as arrays
from model_store import CapacityError, StoreError
from serving.ps import OptimizerSpec, TableShard, TableShardConfig
from serving.ps import index as ps_index
from serving.ps.config import MAX_ROWS
from serving.ps.growth import GIB
from serving.ps.spec import TableSpec
from tests.serving.ps.helpers import store_config


class FakeClock:
    def __init__(self, t: float = 1_700_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def pair(clock, capacity=16, **kw):
    """(a store that must grow, an unbounded reference), configured alike, on one clock."""
    kw.setdefault("dim", 4)
    kw.setdefault("optimizer", OptimizerSpec("adagrad", lr=0.1))
    small = TableShard(store_config(capacity=capacity, **kw), clock=clock)
    reference = TableShard(store_config(capacity=100_000, **kw), clock=clock)
    return small, reference


def contents(store: TableShard) -> dict:
    """Order-independent contents: every per-row array, sorted by sign."""
    snap = store.snapshot()
    order = np.argsort(snap.signs)
    out = {"signs": snap.signs[order], "rows": snap.rows[order], "stamp": snap.stamp[order]}
    out["count"] = snap.count[order]
    out.update({f"state.{k}": v[order] for k, v in snap.state.items()})
    return out


def delta(store: TableShard) -> dict:
    data = store.cut_delta()
    order = np.argsort(data.signs)
    return {"signs": data.signs[order], "rows": data.rows[order], "deleted": np.sort(data.deleted)}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def step(stores, signs, rng, clock) -> None:
    """One training step on every store: insert-lookup (same answer everywhere), then gradients."""
    clock.t += 1
    grads = rng.standard_normal((len(signs), 4)).astype(np.float32)
    answers = [s.lookup(signs, insert=True) for s in stores]
    for rows, misses in answers[1:]:
        np.testing.assert_array_equal(rows, answers[0][0])
        assert misses == answers[0][1]
    for s in stores:
        s.apply_gradients(signs, grads)


# ---- growth == never full ------------------------------------------------------------------------
def test_growth_keeps_every_row_like_an_unbounded_store():
    rng, clock = np.random.default_rng(0), FakeClock()
    small, reference = pair(clock)
    seen = np.empty(0, np.uint64)
    for size in (10, 40, 300, *[600] * 15, 3000):  # 16 -> ~12k rows: growth again and again
        # half known signs, half new, in one batch: growth happens in the middle of a batch, while
        # the known rows of the same batch are being read and updated
        known = rng.choice(seen, size // 2) if len(seen) else np.empty(0, np.uint64)
        new = rng.integers(1, 2**63, size, dtype=np.uint64)
        batch = rng.permutation(np.concatenate([known, new, new[: size // 4]]))  # duplicates too
        step([small, reference], batch, rng, clock)
        seen = np.unique(np.concatenate([seen, new]))
    st = small.stats()
    assert st["grows"] >= 7 and st["evictions"] == 0 and st["expired"] == 0
    assert st["rows"] == len(seen) == len(reference) and st["capacity"] >= len(seen)
    assert reference.stats()["grows"] == 0
    assert small.memory_bytes == small.bytes_for(small.capacity)
    rows, misses = small.lookup(seen)
    assert misses == 0
    np.testing.assert_array_equal(rows, reference.lookup(seen)[0])
    assert_same(contents(small), contents(reference))


def test_growth_by_assign_and_delta_application(tmp_path):
    rng = np.random.default_rng(1)
    small, reference = pair(FakeClock(), capacity=8)
    signs = rng.integers(1, 2**63, 500, dtype=np.uint64)
    rows = rng.standard_normal((500, 4)).astype(np.float32)
    for s in (small, reference):
        assert s.assign(signs, rows) == 500
    assert_same(contents(small), contents(reference))
    reference.dump_delta(tmp_path / "d0")
    follower = TableShard(
        TableShardConfig(table=TableSpec(dim=4, capacity=4, optimizer=OptimizerSpec("adagrad", lr=0.1)))
    )
    assert follower.apply_delta(tmp_path / "d0") == 500 and follower.stats()["grows"] >= 1
    np.testing.assert_array_equal(follower.lookup(signs)[0], rows)


def test_cut_delta_and_ttl_expiry_after_growth():
    rng, clock = np.random.default_rng(2), FakeClock()
    small, reference = pair(clock, ttl_s=100)
    old = rng.integers(1, 2**63, 12, dtype=np.uint64)
    step([small, reference], old, rng, clock)
    assert_same(delta(small), delta(reference))  # cut: nothing dirty any more
    clock.t += 60
    step([small, reference], old[:6], rng, clock)  # dirty before the growth, untouched by its batch
    new = rng.integers(1, 2**63, 3000, dtype=np.uint64)
    step([small, reference], np.concatenate([new, old[:4]]), rng, clock)  # growth mid-batch
    assert small.stats()["grows"] >= 1
    cut = delta(small)
    assert set(cut["signs"].tolist()) == set(new.tolist()) | set(old[:6].tolist())
    assert len(cut["deleted"]) == 0
    assert_same(cut, delta(reference))
    clock.t += 60  # the 6 old rows not touched since before the growth are past the TTL
    assert small.expire() == reference.expire() == 6
    assert small.stats()["expired"] == 6 and small.stats()["evictions"] == 0
    assert not any(x in small for x in old[6:]) and all(x in small for x in old[:6])
    assert_same(contents(small), contents(reference))  # compaction moved the right rows
    cut = delta(small)
    assert set(cut["deleted"].tolist()) == set(old[6:].tolist()) and len(cut["signs"]) == 0
    assert_same(cut, delta(reference))
    step([small, reference], np.concatenate([new[:50], old]), rng, clock)  # expired signs come back
    assert_same(contents(small), contents(reference))
    assert_same(delta(small), delta(reference))


def test_admission_counts_survive_growth():
    clock = FakeClock()
    s = TableShard(TableShardConfig(table=TableSpec(dim=4, capacity=16, min_count=2)), clock=clock)
    early = np.arange(1, 101, dtype=np.uint64)
    s.lookup(early, insert=True)  # seen once: no rows yet
    assert len(s) == 0
    many = np.arange(1000, 4000, dtype=np.uint64)
    s.lookup(many, insert=True)
    s.lookup(many, insert=True)  # 3000 rows: the store and its sketch grew
    assert len(s) == 3000 and s.capacity >= 3000
    _, misses = s.lookup(early, insert=True)  # seen twice, once before the growth
    assert misses == 0 and all(x in s for x in early)


# ---- the limits: loud, and nothing lost -------------------------------------------------------
def test_growth_past_the_memory_limit_fails_loudly_and_keeps_the_rows():
    rng, clock = np.random.default_rng(3), FakeClock()
    probe = TableShard(TableShardConfig(table=TableSpec(dim=4)))
    limit_gb = probe.bytes_for(100) / GIB  # room for 100 rows
    s = TableShard(TableShardConfig(table=TableSpec(dim=4, capacity=16, max_memory_gb=limit_gb)), clock=clock)
    first = rng.integers(1, 2**63, 70, dtype=np.uint64)
    s.lookup(first[:60], insert=True)
    assert s.capacity == 60
    s.lookup(first, insert=True)
    assert s.capacity == 100  # grew less than 2x: 120 rows would not fit
    s.apply_gradients(first, np.ones((70, 4), np.float32))
    before = contents(s)
    with pytest.raises(CapacityError) as e:
        s.lookup(rng.integers(1, 2**63, 40, dtype=np.uint64), insert=True)
    message = str(e.value)
    for part in ("110 rows", "70 held", f"max_memory_gb={limit_gb:g}", "--num-shards", "--max-memory-gb",
                 "--eviction lru|lfu"):  # fmt: skip
        assert part in message, message
    assert isinstance(e.value, StoreError) and e.value.grpc_status == "RESOURCE_EXHAUSTED"
    assert_same(contents(s), before)
    assert s.capacity == 100 and s.memory_bytes <= limit_gb * GIB and s.stats()["evictions"] == 0
    rows, misses = s.lookup(first)  # still serving and training what it holds
    assert misses == 0
    s.lookup(rng.integers(1, 2**63, 30, dtype=np.uint64), insert=True)  # what fits still goes in
    assert len(s) == 100
    with pytest.raises(CapacityError, match="capacity 1,000,000 rows needs"):
        TableShard(
            TableShardConfig(table=TableSpec(dim=4, max_memory_gb=limit_gb))
        )  # the first allocation, too


def test_a_memory_error_during_growth_is_the_same_loud_error(monkeypatch):
    s = TableShard(TableShardConfig(table=TableSpec(dim=4, capacity=16)))
    s.lookup(np.arange(1, 17, dtype=np.uint64), insert=True)
    before = contents(s)
    real = arrays.zeros

    def allocator_out_of_memory(shape, dtype):
        if shape[0] > 16 and len(shape) == 2:  # the grown rows
            raise MemoryError("Unable to allocate")
        return real(shape, dtype)

    monkeypatch.setattr(arrays, "zeros", allocator_out_of_memory)
    with pytest.raises(CapacityError, match="could not allocate"):
        s.lookup(np.arange(100, 120, dtype=np.uint64), insert=True)
    assert_same(contents(s), before)
    assert s.capacity == 16 and s.stats()["grows"] == 0


def test_one_shard_cannot_pass_the_int32_row_position_limit():
    s = TableShard(TableShardConfig(table=TableSpec(dim=4, capacity=16)))
    with pytest.raises(CapacityError, match="int32 row positions"):
        s._grow(MAX_ROWS + 1, keep=0)
    with pytest.raises(ValueError, match="int32"):
        TableShardConfig(table=TableSpec(capacity=2**31 - 1))
    assert ps_index.position_bits(MAX_ROWS) == 31  # the largest capacity still fits an int32 entry


# ---- eviction only when configured, and counted -------------------------------------------------
def test_the_default_never_evicts():
    cfg = TableShardConfig(table=TableSpec(dim=4, capacity=8))
    assert cfg.eviction == "none" and cfg.max_memory_gb == 0 and cfg.ttl_s == 0
    s = TableShard(cfg)
    signs = np.arange(1, 1001, dtype=np.uint64)
    for chunk in np.split(signs, 10):
        s.lookup(chunk, insert=True)
    assert s.lookup(signs)[1] == 0 and s.expire() == 0
    st = s.stats()
    assert (st["rows"], st["evictions"], st["expired"], st["eviction"]) == (1000, 0, 0, "none")


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_configured_eviction_bounds_the_store_and_counts_and_logs(policy, caplog):
    clock = FakeClock()
    s = TableShard(TableShardConfig(table=TableSpec(dim=4, capacity=50, eviction=policy)), clock=clock)
    with caplog.at_level(logging.INFO, logger="recserve.ps.store"):
        for i in range(40):
            clock.t += 1
            s.lookup(np.arange(10 * i, 10 * i + 10, dtype=np.uint64), insert=True)
    st = s.stats()
    assert st["rows"] == 50 and st["capacity"] == 50 and st["grows"] == 0
    assert st["evictions"] == 350 == st["inserts"] - st["rows"]
    lines = [r.getMessage() for r in caplog.records if "evicted" in r.getMessage()]
    assert 1 <= len(lines) < 30, lines  # a running total now and then, not a line per pass
    assert f"({policy} at capacity 50)" in lines[0]


def test_a_delta_past_the_memory_limit_is_refused_whole(tmp_path):
    rng, clock = np.random.default_rng(4), FakeClock()
    trainer = TableShard(TableShardConfig(table=TableSpec(dim=4, capacity=16, ttl_s=10)), clock=clock)
    old = rng.integers(1, 2**63, 50, dtype=np.uint64)
    trainer.lookup(old, insert=True)
    trainer.dump(tmp_path / "base")
    clock.t += 5
    trainer.lookup(np.concatenate([old[10:], rng.integers(1, 2**63, 200, dtype=np.uint64)]), insert=True)
    clock.t += 6
    assert trainer.expire() == 10
    trainer.dump_delta(tmp_path / "d0")  # 10 deletions, 240 rows of which 200 new
    limit_gb = trainer.bytes_for(100) / GIB
    serving = TableShard(TableShardConfig(table=TableSpec(dim=4, capacity=16, max_memory_gb=limit_gb)))
    serving.load(tmp_path / "base")
    before = contents(serving)
    with pytest.raises(CapacityError, match="max_memory_gb"):
        serving.apply_delta(tmp_path / "d0")
    assert_same(contents(serving), before)  # not even the delta's deletions
    assert serving.delta_seq == -1
