"""The PS store without a network: insert/lookup/admission/eviction/TTL, dirty tracking, and each
sparse optimizer against a small numpy reference (and torch, where installed)."""

from __future__ import annotations

import numpy as np
import pytest

from serving.ps import OptimizerSpec, TableShard, TableShardConfig
from serving.ps import index as ps_index
from tests.serving.ps.helpers import FakeClock, store_config


def make(clock=None, **kw) -> TableShard:
    kw.setdefault("dim", 4)
    kw.setdefault("capacity", 64)
    return TableShard(store_config(**kw), clock=clock or FakeClock())


def u64(*xs) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


# ---- the index kernels --------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [7, 30])  # 30: one fingerprint bit, so fingerprints collide often
def test_index_kernels_against_a_dict(bits):
    rng = np.random.default_rng(bits)
    cap = 100
    table = np.full(ps_index.table_size(cap), ps_index.EMPTY, np.int32)
    keys = np.zeros(cap, np.uint64)
    rows = np.arange(cap * 2, dtype=np.float32).reshape(cap, 2)
    n = 0
    universe = rng.integers(0, 2**64 - 1, 300, dtype=np.uint64)
    for _ in range(40):
        present = set(keys[:n].tolist())
        new = np.array([x for x in rng.choice(universe, 20) if int(x) not in present], np.uint64)
        new = np.unique(new)[: cap - n]
        ps_index.insert_new(table, keys, new, n, bits)
        rows[n : n + len(new)] = new[:, None].astype(np.float32) % 1000
        n += len(new)
        victims = np.sort(rng.choice(n, min(n, 7), replace=False)).astype(np.int64)
        src, dst = ps_index.remove_compact(table, keys, victims, n, bits)
        rows[dst] = rows[src]
        n -= len(victims)
        want = {int(k): i for i, k in enumerate(keys[:n])}
        assert len(want) == n
        probe = rng.choice(universe, 50)
        rows_at = ps_index.find_positions(table, keys, probe, bits)
        assert rows_at.tolist() == [want.get(int(x), -1) for x in probe]
        out = np.empty((50, 2), np.float32)
        misses = ps_index.gather_rows(table, keys, rows, probe, bits, out)
        assert misses == int((rows_at < 0).sum())
        np.testing.assert_array_equal(out, np.where(rows_at[:, None] >= 0, rows[np.maximum(rows_at, 0)], 0))
    assert ps_index.rebuild(table, keys, n, bits) == 0
    assert ps_index.find_positions(table, keys, keys[:n], bits).tolist() == list(range(n))
    keys[1] = keys[0]
    assert ps_index.rebuild(table, keys, n, bits) == 1


# ---- lookup, insert, init ---------------------------------------------------------------------
def test_serving_lookup_never_inserts_and_counts_misses():
    s = make()
    rows, misses = s.lookup(u64(1, 2, 3))
    assert misses == 3 and len(s) == 0
    assert rows.shape == (3, 4) and rows.dtype == np.float32 and not rows.any()
    assert s.stats()["misses"] == 3


def test_insert_then_lookup_returns_the_same_rows_in_request_order():
    s = make()
    rows, misses = s.lookup(u64(5, 7, 5, 9), insert=True)
    assert misses == 0 and len(s) == 3
    np.testing.assert_array_equal(rows[0], rows[2])
    again, misses = s.lookup(u64(9, 5, 7, 11))
    assert misses == 1
    np.testing.assert_array_equal(again[:3], rows[[3, 0, 1]])
    assert not again[3].any()


def test_init_is_deterministic_from_sign_and_seed():
    signs = np.random.default_rng(0).integers(0, 2**64 - 1, 100, dtype=np.uint64)
    a, _ = make(capacity=200, init_scale=0.5, seed=3).lookup(signs, insert=True)
    b, _ = make(capacity=200, init_scale=0.5, seed=3).lookup(signs[::-1], insert=True)
    c, _ = make(capacity=200, init_scale=0.5, seed=4).lookup(signs, insert=True)
    np.testing.assert_array_equal(a, b[::-1])
    assert not np.array_equal(a, c)
    assert np.abs(a).max() <= 0.5 and np.abs(a).max() > 0.4 and abs(a.mean()) < 0.05
    assert len(np.unique(a)) > 390  # elements are not repeated across a row or across signs


def test_float16_storage():
    s = make(dtype="float16", init_scale=1.0)
    rows, _ = s.lookup(u64(1, 2), insert=True)
    ref = ps_index.init_rows(u64(1, 2), 4, np.uint64(0), 1.0).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(rows, ref)
    s.apply_gradients(u64(1), np.ones((1, 4), np.float32))
    after, misses = s.lookup(u64(1, 2, 3))
    assert misses == 1 and not np.array_equal(after[0], rows[0])
    assert s.memory_bytes < make().memory_bytes


def test_admission_min_count():
    s = make(min_count=3)
    for _ in range(2):
        rows, misses = s.lookup(u64(42), insert=True)
        assert misses == 1 and not rows.any() and len(s) == 0
    rows, misses = s.lookup(u64(42), insert=True)
    assert misses == 0 and rows.any() and 42 in s
    # occurrences inside one batch count too
    _, misses = s.lookup(u64(7, 7, 7), insert=True)
    assert misses == 0 and 7 in s


# ---- eviction and TTL -------------------------------------------------------------------------
def test_lru_evicts_least_recently_touched():
    clock = FakeClock()
    s = make(clock, capacity=8, evict_fraction=0.0, eviction="lru")
    for sign in range(1, 9):
        clock.t += 1
        s.lookup(u64(sign), insert=True)
    clock.t += 1
    s.lookup(u64(1, 2), insert=True)  # 1 and 2 are now the most recent
    clock.t += 1
    s.lookup(u64(100, 101), insert=True)
    assert len(s) == 8 and s.evictions == 2
    assert 3 not in s and 4 not in s and all(x in s for x in (1, 2, 5, 6, 7, 8, 100, 101))
    # evicted signs are published with the next delta
    delta = s.cut_delta()
    assert set(delta.deleted.tolist()) == {3, 4}


def test_lfu_evicts_least_frequently_touched_and_never_the_batch_itself():
    s = make(capacity=4, evict_fraction=0.0, eviction="lfu")
    s.lookup(u64(1, 2, 3, 4), insert=True)
    s.lookup(u64(1, 1, 2, 3, 4), insert=True)
    s.lookup(u64(1, 2, 4), insert=True)  # counts: 1:3, 2:3, 3:2, 4:3
    rows, misses = s.lookup(u64(9, 3), insert=True)  # 3 is in the batch: protected
    assert misses == 0 and 9 in s and 3 in s and len(s) == 4
    assert sum(x in s for x in (1, 2, 4)) == 2


def test_eviction_keeps_rows_attached_to_their_signs():
    rng = np.random.default_rng(1)
    s = make(capacity=50, evict_fraction=0.1, eviction="lfu")
    for _ in range(30):
        s.lookup(rng.integers(1, 200, 20).astype(np.uint64), insert=True)
    signs = s.snapshot().signs
    rows, misses = s.lookup(signs)
    assert misses == 0 and len(s) <= 50
    np.testing.assert_array_equal(rows, ps_index.init_rows(signs, 4, np.uint64(0), 0.01))


def test_ttl_expiry():
    clock = FakeClock()
    s = make(clock, ttl_s=10)
    s.lookup(u64(1, 2), insert=True)
    clock.t += 6
    s.apply_gradients(u64(2), np.ones((1, 4)))
    clock.t += 6
    assert s.expire() == 1
    assert 1 not in s and 2 in s and s.stats()["expired"] == 1
    assert make(ttl_s=0).expire() == 0


# ---- dirty tracking ---------------------------------------------------------------------------
def test_delta_cut_holds_changed_rows_and_deletions():
    clock = FakeClock()
    s = make(clock, capacity=4, evict_fraction=0.0, eviction="lru")
    s.lookup(u64(1, 2, 3), insert=True)
    first = s.cut_delta()
    assert sorted(first.signs.tolist()) == [1, 2, 3] and first.meta.delta_seq == 0
    s.apply_gradients(u64(2), np.ones((1, 4)))
    clock.t += 1
    s.lookup(u64(1, 2, 3, 4), insert=True)
    clock.t += 1
    s.lookup(u64(5), insert=True)  # 1..4 touched at the same time; 4 has the lowest count
    d = s.cut_delta()
    assert d.meta.delta_seq == 1
    assert sorted(d.signs.tolist()) == [2, 5] and d.deleted.tolist() == [4]
    np.testing.assert_array_equal(d.rows[d.signs == 2], s.lookup(u64(2))[0])
    assert len(s.cut_delta().signs) == 0


# ---- input checks -----------------------------------------------------------------------------
def test_apply_gradients_rejects_bad_input():
    s = make()
    s.lookup(u64(1), insert=True)
    with pytest.raises(ValueError, match="shape"):
        s.apply_gradients(u64(1), np.ones((1, 3)))
    with pytest.raises(ValueError, match="NaN or Inf"):
        s.apply_gradients(u64(1), np.full((1, 4), np.nan))
    with pytest.raises(ValueError, match="NaN or Inf"):
        s.apply_gradients(u64(1), np.full((1, 4), np.inf))
    assert s.apply_gradients(u64(99), np.ones((1, 4))) == 0  # no row: skipped


def test_config_validation():
    for bad in ({"dtype": "int8"}, {"eviction": "fifo"}, {"dim": 0}, {"shard": 2, "num_shards": 2},
                {"max_memory_gb": -1.0}, {"ttl_s": -1.0}):  # fmt: skip
        with pytest.raises(ValueError):
            store_config(**bad)
    with pytest.raises(ValueError, match="unknown optimizer"):
        OptimizerSpec(name="lamb")
    cfg = TableShardConfig.from_dict({"table": {"dim": 8, "optimizer": {"name": "ftrl", "lr": 0.1}}})
    assert cfg.optimizer.name == "ftrl"


def test_memory_is_within_15_percent_of_raw():
    for cap in (1000, 65_536, 100_000):
        s = make(dim=16, capacity=cap, optimizer=OptimizerSpec("adagrad"))
        assert s.raw_bytes_per_row == 8 + 16 * 4 * 2
        assert s.memory_bytes / cap <= 1.15 * s.raw_bytes_per_row


# ---- optimizers -------------------------------------------------------------------------------
def reference_step(name, cfg, p, st, g_by_sign, step):
    """Row-at-a-time numpy reference of one sparse step; p/st dicts sign -> float32 arrays."""
    for sign, g in g_by_sign.items():
        w = p[sign]
        if name == "sgd":
            p[sign] = w - np.float32(cfg.lr) * g
        elif name == "adagrad":
            s = st[sign]["sum"] + g * g
            st[sign]["sum"] = s
            p[sign] = w - np.float32(cfg.lr) * g / (np.sqrt(s) + np.float32(1e-10))
        elif name == "adam":
            m = np.float32(cfg.beta1) * st[sign]["m"] + np.float32(1 - cfg.beta1) * g
            v = np.float32(cfg.beta2) * st[sign]["v"] + np.float32(1 - cfg.beta2) * g * g
            st[sign]["m"], st[sign]["v"] = m, v
            mhat = m / (1 - cfg.beta1**step)
            vhat = v / (1 - cfg.beta2**step)
            p[sign] = w - cfg.lr * mhat / (np.sqrt(vhat) + 1e-8 * np.sqrt(1 / (1 - cfg.beta2**step)))
        else:  # FTRL-Proximal, McMahan et al. 2013, Algorithm 1, in float64
            z, n = st[sign]["z"].astype(np.float64), st[sign]["n"].astype(np.float64)
            g = g.astype(np.float64)
            sigma = (np.sqrt(n + g * g) - np.sqrt(n)) / cfg.lr
            z = z + g - sigma * w
            n = n + g * g
            w_new = np.where(
                np.abs(z) <= cfg.l1,
                0.0,
                -(z - np.sign(z) * cfg.l1) / ((cfg.ftrl_beta + np.sqrt(n)) / cfg.lr + cfg.l2),
            )
            st[sign]["z"], st[sign]["n"] = z.astype(np.float32), n.astype(np.float32)
            p[sign] = w_new.astype(np.float32)


@pytest.mark.parametrize(
    "cfg",
    [
        OptimizerSpec("sgd", lr=0.1),
        OptimizerSpec("adagrad", lr=0.1),
        OptimizerSpec("adam", lr=0.01),
        OptimizerSpec("ftrl", lr=0.5, l1=0.01, l2=0.1, ftrl_beta=1.0),
    ],
    ids=lambda c: c.name,
)
def test_optimizer_matches_numpy_reference(cfg):
    rng = np.random.default_rng(7)
    dim = 4
    init_scale = 0.0 if cfg.name == "ftrl" else 0.1
    s = make(dim=dim, capacity=32, optimizer=cfg, init_scale=init_scale)
    pool = np.arange(1, 21, dtype=np.uint64)
    rows, _ = s.lookup(pool, insert=True)
    p = {int(k): rows[i].copy() for i, k in enumerate(pool)}
    zero = np.zeros(dim, np.float32)
    st = {int(k): {"sum": zero, "m": zero, "v": zero, "z": zero, "n": zero} for k in pool}
    for step in range(1, 6):
        signs = rng.choice(pool, 30)  # duplicates inside the batch
        grads = rng.standard_normal((30, dim)).astype(np.float32)
        g_by_sign = {}
        for sign, g in zip(signs.tolist(), grads, strict=True):
            g_by_sign[sign] = g_by_sign.get(sign, zero) + g
        reference_step(cfg.name, cfg, p, st, g_by_sign, step)
        assert s.apply_gradients(signs, grads) == len(g_by_sign)
    got, _ = s.lookup(pool)
    want = np.stack([p[int(k)] for k in pool])
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6)
    assert len(s.cut_delta().signs) == len(pool)


def test_ftrl_l1_gives_exact_zeros():
    s = make(optimizer=OptimizerSpec("ftrl", lr=0.1, l1=10.0), init_scale=0.0)
    s.lookup(u64(1), insert=True)
    s.apply_gradients(u64(1), np.full((1, 4), 0.5))
    rows, _ = s.lookup(u64(1))
    assert not rows.any()


@pytest.mark.parametrize("name", ["sgd", "adagrad", "adam"])
def test_optimizer_matches_torch(name):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    dim, vocab = 8, 16
    cfg = OptimizerSpec(name, lr=0.05)
    s = make(dim=dim, capacity=vocab, optimizer=cfg, init_scale=0.2)
    signs = np.arange(100, 100 + vocab, dtype=np.uint64)
    rows, _ = s.lookup(signs, insert=True)
    sparse = name == "adam"
    emb = torch.nn.Embedding(vocab, dim, sparse=sparse)
    emb.weight.data = torch.from_numpy(rows.copy())
    opt = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
        "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05),
        "adam": lambda ps: torch.optim.SparseAdam(ps, lr=0.05),
    }[name](emb.parameters())
    for _ in range(4):
        idx = rng.integers(0, vocab // 2 + 4, 24)
        target = torch.from_numpy(rng.standard_normal((24, dim)).astype(np.float32))
        out = emb(torch.from_numpy(idx))
        out.retain_grad()
        loss = ((out - target) ** 2).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        s.apply_gradients(signs[idx], out.grad.numpy())
    got, _ = s.lookup(signs)
    np.testing.assert_allclose(got, emb.weight.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_optimizer_state_is_per_row():
    s = make(optimizer=OptimizerSpec("adagrad", lr=1.0, initial_accumulator_value=0.5))
    s.lookup(u64(1, 2), insert=True)
    before, _ = s.lookup(u64(1, 2))
    s.apply_gradients(u64(1), np.ones((1, 4)))
    after, _ = s.lookup(u64(1, 2))
    np.testing.assert_allclose(after[0], before[0] - 1.0 / np.sqrt(1.5), rtol=1e-6)
    np.testing.assert_array_equal(after[1], before[1])


def test_assign_sets_rows_and_optimizer_state_and_marks_them_for_the_delta():
    s = make(optimizer=OptimizerSpec("adagrad", lr=0.1))
    s.lookup(u64(1), insert=True)
    s.cut_delta()
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    assert s.assign(u64(1, 2), rows, {"sum": rows + 1}) == 2  # 2 is inserted
    np.testing.assert_array_equal(s.lookup(u64(1, 2))[0], rows)
    delta = s.cut_delta()
    assert sorted(delta.signs.tolist()) == [1, 2]
    np.testing.assert_array_equal(delta.state["sum"][np.argsort(delta.signs)], rows + 1)
    s.assign(u64(1), rows[:1] * 0)  # no state given: it stays
    assert s.snapshot().state["sum"][0].tolist() == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="state must be float32"):
        s.assign(u64(3), rows[:1], {"exp_avg": rows[:1]})
    with pytest.raises(ValueError, match="finite"):
        s.assign(u64(3), np.full((1, 4), np.nan))


def test_the_former_class_names_still_work_with_a_deprecation_warning():
    import serving.ps
    from serving.ps.config import TableShardConfig
    from serving.ps.shard import TableShard

    with pytest.warns(DeprecationWarning, match="serving.ps.EmbeddingStore is now serving.ps.TableShard"):
        assert serving.ps.EmbeddingStore is TableShard
    with pytest.warns(DeprecationWarning, match="serving.ps.StoreConfig is now serving.ps.TableShardConfig"):
        assert serving.ps.StoreConfig is TableShardConfig
