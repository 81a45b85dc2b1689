"""Shard dumps: bit-identical round trip, base + deltas == full dump, re-sharding, and refusal
of incomplete, corrupt or incompatible dumps."""

from __future__ import annotations

import numpy as np
import pytest

from features.hashing import shard_of
from model_store import CapacityError, shards
from model_store.errors import StoreError
from serving.ps import OptimizerSpec, TableShard
from tests.serving.ps.helpers import store_config


class FakeClock:
    def __init__(self):
        self.t = 1_700_000_000.0

    def __call__(self):
        return self.t


def make(**kw) -> TableShard:
    kw.setdefault("dim", 4)
    kw.setdefault("capacity", 500)
    kw.setdefault("optimizer", OptimizerSpec("adam", lr=0.01))
    clock = kw.pop("clock", None) or FakeClock()
    return TableShard(store_config(**kw), clock=clock)


def train(store: TableShard, rng, steps: int, pool: int = 300, batch: int = 64) -> None:
    for _ in range(steps):
        signs = rng.integers(1, pool, batch).astype(np.uint64)
        if store.config.num_shards > 1:
            signs = signs[shard_of(signs, store.config.num_shards) == store.config.shard]
        store.lookup(signs, insert=True)
        store.apply_gradients(signs, rng.standard_normal((len(signs), store.config.dim)))


def contents(store: TableShard) -> dict:
    """Order-independent content: arrays sorted by sign."""
    snap = store.snapshot()
    order = np.argsort(snap.signs)
    out = {
        "signs": snap.signs[order],
        "rows": snap.rows[order],
        "stamp": snap.stamp[order],
        "count": snap.count[order],
    }
    out.update({f"state.{k}": v[order] for k, v in snap.state.items()})
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_dump_load_is_bit_identical(tmp_path):
    rng = np.random.default_rng(0)
    a = make(schema_hash="abc")
    train(a, rng, 10)
    a.version = "v1"
    path = a.dump(tmp_path / "one")
    assert path.name == "shard-0-of-1"
    assert sorted(p.name for p in path.iterdir()) == [
        "MANIFEST.json",
        "_SUCCESS",
        "buckets.npy",
        "count.npy",
        "meta.json",
        "rows.npy",
        "signs.npy",
        "stamp.npy",
        "state.exp_avg.npy",
        "state.exp_avg_sq.npy",
    ]
    assert not [p for p in (tmp_path / "one").iterdir() if p.name.startswith(".")]  # no temp dirs left
    b = make(schema_hash="abc")
    assert b.load(tmp_path / "one") == len(a)
    assert (b.version, b.delta_seq, b.step) == ("v1", a.delta_seq, a.step)
    b.dump(tmp_path / "two")
    for name in (
        "signs.npy",
        "rows.npy",
        "state.exp_avg.npy",
        "state.exp_avg_sq.npy",
        "stamp.npy",
        "count.npy",
    ):
        assert (tmp_path / "one/shard-0-of-1" / name).read_bytes() == (
            tmp_path / "two/shard-0-of-1" / name
        ).read_bytes()
    signs = a.snapshot().signs
    np.testing.assert_array_equal(a.lookup(signs)[0], b.lookup(signs)[0])
    # training continues identically from the loaded copy
    grads = rng.standard_normal((len(signs), 4))
    a.apply_gradients(signs, grads)
    b.apply_gradients(signs, grads)
    np.testing.assert_array_equal(a.lookup(signs)[0], b.lookup(signs)[0])


def test_full_dump_equals_base_plus_deltas(tmp_path):
    rng = np.random.default_rng(1)
    clock = FakeClock()
    train_store = make(capacity=200, evict_fraction=0.05, clock=clock, eviction="lru")  # evictions happen
    train(train_store, rng, 5)
    train_store.version = "v7"
    train_store.dump(tmp_path / "base")
    for seq in range(3):
        clock.t += 1
        train(train_store, rng, 4)
        path = train_store.dump_delta(tmp_path / "deltas" / str(seq))
        assert shards.read_meta(path).delta_seq == seq
    assert train_store.evictions > 0
    train_store.dump(tmp_path / "full")

    serving = make(capacity=200)
    serving.load(tmp_path / "base")
    assert serving.delta_seq == -1
    for seq in range(3):
        serving.apply_delta(tmp_path / "deltas" / str(seq))
        assert serving.delta_seq == seq
    full = make(capacity=200)
    full.load(tmp_path / "full")
    assert_same(contents(serving), contents(full))
    assert_same(contents(serving), contents(train_store))
    # applying a delta again is harmless; a gap is refused
    assert serving.apply_delta(tmp_path / "deltas" / "2") == 0
    assert_same(contents(serving), contents(full))
    other = make(capacity=200)
    other.load(tmp_path / "base")
    with pytest.raises(StoreError, match="does not follow"):
        other.apply_delta(tmp_path / "deltas" / "1")
    with pytest.raises(StoreError, match="expected a delta"):
        other.apply_delta(tmp_path / "base")


def test_reshard_2_to_3(tmp_path):
    rng = np.random.default_rng(2)
    olds = [make(shard=i, num_shards=2) for i in range(2)]
    for s in olds:
        train(s, rng, 8)
        s.dump(tmp_path / "v1")
    union = {k: np.concatenate([contents(s)[k] for s in olds]) for k in contents(olds[0])}
    news = [make(shard=i, num_shards=3) for i in range(3)]
    for i, s in enumerate(news):
        s.load(tmp_path / "v1")
        assert (shard_of(s.snapshot().signs, 3) == i).all()
    merged = {k: np.concatenate([contents(s)[k] for s in news]) for k in union}
    order_u, order_m = np.argsort(union["signs"]), np.argsort(merged["signs"])
    for k in union:
        np.testing.assert_array_equal(union[k][order_u], merged[k][order_m], err_msg=k)
    # the same via an explicit list of shard directories and explicit shard arguments
    s = make()
    s.load([tmp_path / "v1/shard-0-of-2", tmp_path / "v1/shard-1-of-2"], shard=1, num_shards=3)
    assert_same(contents(s), contents(news[1]))


def test_reshard_deltas(tmp_path):
    rng = np.random.default_rng(3)
    olds = [make(shard=i, num_shards=2) for i in range(2)]
    for s in olds:
        train(s, rng, 3)
        s.dump(tmp_path / "base")
        train(s, rng, 3)
        s.dump_delta(tmp_path / "d0")
    news = [make(shard=i, num_shards=3) for i in range(3)]
    for s in news:
        s.load(tmp_path / "base")
        s.apply_delta(tmp_path / "d0")
    assert sum(len(s) for s in news) == sum(len(s) for s in olds)
    for s in olds:
        signs = s.snapshot().signs
        got = np.zeros((len(signs), 4), np.float32)
        for i, n in enumerate(news):
            mine = shard_of(signs, 3) == i
            got[mine] = n.lookup(signs[mine])[0]
        np.testing.assert_array_equal(got, s.lookup(signs)[0])


@pytest.fixture
def dumped(tmp_path):
    s = make(schema_hash="abc")
    train(s, np.random.default_rng(4), 3)
    return s.dump(tmp_path / "v")


def test_refuses_missing_success(dumped):
    (dumped / "_SUCCESS").unlink()
    with pytest.raises(StoreError, match="_SUCCESS"):
        make().load(dumped)


def test_refuses_bad_checksum(dumped):
    data = bytearray((dumped / "rows.npy").read_bytes())
    data[-1] ^= 1
    (dumped / "rows.npy").write_bytes(bytes(data))
    with pytest.raises(StoreError, match="checksum"):
        make().load(dumped)


def test_refuses_incompatible_dumps(dumped):
    with pytest.raises(StoreError, match="dim 4 does not match the store's dim 8"):
        make(dim=8).load(dumped)
    with pytest.raises(StoreError, match="dtype float32 does not match"):
        make(dtype="float16").load(dumped)
    with pytest.raises(StoreError, match="schema hash"):
        make(schema_hash="other").load(dumped)
    s = make()  # a store without a schema hash adopts the dump's
    s.load(dumped)
    assert s.config.schema_hash == "abc"


def test_a_dump_bigger_than_the_capacity_loads_whole_within_the_memory_limit(dumped):
    full = make()
    full.load(dumped)
    for eviction in ("none", "lru"):  # a version is never refused (or cut) for the capacity
        small = make(capacity=5, eviction=eviction)
        assert small.load(dumped) == len(full) > 5
        assert small.capacity == len(full) and small.stats()["grows"] == 1 and small.evictions == 0
        assert_same(contents(small), contents(full))
    limited = make(capacity=5, max_memory_gb=2000 / 2**30)  # room for ~5 rows, not the dump's
    limited.lookup(np.array([7], np.uint64), insert=True)
    with pytest.raises(CapacityError, match="max_memory_gb") as e:
        limited.load(dumped)
    assert isinstance(e.value, StoreError)  # a refused dump, like any other
    assert len(limited) == 1 and 7 in limited and limited.capacity == 5  # unchanged


def test_refuses_incomplete_shard_sets(tmp_path):
    s = make(shard=0, num_shards=2)
    s.dump(tmp_path / "v")
    with pytest.raises(StoreError, match=r"shards \[1\] of 2 are missing"):
        make().load(tmp_path / "v")
    with pytest.raises(StoreError, match="no such dump"):
        make().load(tmp_path / "nope")


def test_failed_write_leaves_nothing_and_keeps_the_delta_pending(tmp_path, monkeypatch):
    s = make()
    train(s, np.random.default_rng(5), 2)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(shards, "fsync_dir", boom)
    with pytest.raises(OSError):
        s.dump_delta(tmp_path / "d")
    assert list((tmp_path / "d").iterdir()) == []
    assert s.delta_seq == -1
    monkeypatch.undo()
    delta = s.cut_delta()
    assert len(delta.signs) == len(s) and delta.meta.delta_seq == 0


def test_optimizer_change_resets_state(dumped):
    s = make(optimizer=OptimizerSpec("adagrad", initial_accumulator_value=0.1))
    n = s.load(dumped)
    assert n > 0 and (s.snapshot().state["sum"] == np.float32(0.1)).all()


def test_refused_load_keeps_the_served_rows(tmp_path, dumped):
    s = make(schema_hash="abc")
    s.load(dumped)
    before = contents(s)
    snap = s.snapshot()
    snap.signs[1] = snap.signs[0]  # a dump with a duplicate sign (checksums are fine)
    bad = shards.write_shard(tmp_path / "dup", snap)
    with pytest.raises(StoreError, match="duplicate"):
        s.load(bad)
    data = bytearray((dumped / "signs.npy").read_bytes())
    data[-1] ^= 1
    (dumped / "signs.npy").write_bytes(bytes(data))
    with pytest.raises(StoreError, match="checksum"):
        s.load(dumped)
    assert_same(contents(s), before)


def test_a_dump_reaches_its_files_in_whole_aligned_blocks(tmp_path, monkeypatch):
    """Shard files are written in whole blocks at block-aligned offsets (the page cache then
    holds them in 2 MB folios), whatever pieces the writer is given and however short the file's
    writes; the bytes, size and digest are the pieces' in order; a dump so written loads whole."""
    import xxhash

    class File:
        def __init__(self, cap):
            self.cap, self.data, self.calls = cap, bytearray(), []

        def write(self, b):
            n = min(len(b), self.cap)
            self.calls.append((len(self.data), len(b)))
            self.data += bytes(b[:n])
            return n

    monkeypatch.setattr(shards._HashingWriter, "BLOCK", 256)
    pieces = [
        b"h" * 128,
        np.arange(70, dtype=np.uint64),
        b"",
        bytes(range(200)) * 3,
        np.ones((3, 5), np.float32),
    ]
    whole = b"".join(memoryview(p).cast("B").tobytes() for p in pieces)
    for cap in (1 << 30, 100):  # 100: a file that takes at most 100 bytes a call
        f = File(cap)
        hw = shards._HashingWriter(f)
        assert [hw.write(p) for p in pieces] == [len(memoryview(p).cast("B")) for p in pieces]
        hw.close()
        assert bytes(f.data) == whole and hw.size == len(whole)
        assert hw.xxh.hexdigest() == xxhash.xxh3_128(whole).hexdigest()
        if cap > len(whole):  # every call whole: the blocks as the writer cut them
            assert all(off % 256 == 0 for off, _ in f.calls)
            assert all(n % 256 == 0 for _, n in f.calls[:-1]) and sum(n for _, n in f.calls) == len(whole)
    rng = np.random.default_rng(1)
    a = make()
    train(a, rng, 10)
    path = a.dump(tmp_path / "d")
    assert (path / "rows.npy").stat().st_size > 4 * 256
    b = make()
    assert b.load(tmp_path / "d") == len(a)
    signs = a.snapshot().signs
    np.testing.assert_array_equal(a.lookup(signs)[0], b.lookup(signs)[0])
