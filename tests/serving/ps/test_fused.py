"""The optimizers' fast paths (serving/ps/fused.py), named by their registry entries: for distinct
signs a fused find + update gives the numpy path's rows, state, stamps and dirty marks bit for
bit, and skips absent signs."""

from __future__ import annotations

import numpy as np
import pytest

from serving.ps import OptimizerSpec, TableShard, optim
from tests.serving.ps.helpers import FakeClock, store_config

FUSED = sorted(name for name, entry in optim.OPTIMIZERS.items() if entry.fused)


def test_sgd_and_adagrad_have_a_fast_path_and_the_rest_none():
    assert FUSED == ["adagrad", "sgd"]
    assert all(optim.get(name).kernel() is not None for name in FUSED)
    assert optim.get("ftrl").kernel() is None


@pytest.mark.parametrize("name", FUSED)
def test_the_fused_update_of_distinct_signs_is_bit_identical_to_the_numpy_path(name):
    clock = FakeClock()
    a, b = (
        TableShard(store_config(dim=8, capacity=600, optimizer=OptimizerSpec(name, lr=0.05)), clock=clock)
        for _ in range(2)
    )
    rng = np.random.default_rng(0)
    for _ in range(20):
        signs = np.unique(rng.integers(1, 500, 100).astype(np.uint64))
        rng.shuffle(signs)
        grads = rng.standard_normal((len(signs), 8)).astype(np.float32)
        a.lookup(signs, insert=True)
        b.lookup(signs, insert=True)
        clock.t += 1
        assert a.apply_gradients(signs, grads) == b.apply_gradients(signs, grads, distinct=True)
    absent = np.array([10_000], np.uint64)
    assert b.apply_gradients(absent, np.ones((1, 8), np.float32), distinct=True) == 0
    every = np.arange(1, 500, dtype=np.uint64)
    np.testing.assert_array_equal(a.lookup(every)[0], b.lookup(every)[0])
    for x, y in ((a.snapshot(), b.snapshot()), (a.cut_delta(), b.cut_delta())):  # all; the dirty ones
        np.testing.assert_array_equal(x.signs, y.signs)
        np.testing.assert_array_equal(x.rows, y.rows)
        np.testing.assert_array_equal(x.stamp, y.stamp)
        assert x.state.keys() == y.state.keys() == set(optim.get(name).state)
        for k in x.state:
            np.testing.assert_array_equal(x.state[k], y.state[k])
