"""The trained keys: a key trained once is not new again, within a batch too; keys older than the
window are forgotten."""

from __future__ import annotations

import numpy as np
import pytest

from training.follow.trained_keys import TrainedKeys


def test_a_key_is_new_once():
    keys = TrainedKeys(window_s=100)
    batch = np.array([b"a", b"b", b"a"])
    assert keys.new(batch).tolist() == [True, True, False]
    keys.add(batch[keys.new(batch)], np.array([10.0, 10.0]))
    assert keys.new(np.array([b"b", b"c"])).tolist() == [False, True]


def test_keys_out_of_the_window_are_forgotten():
    keys = TrainedKeys(window_s=5)
    keys.add(np.array([b"old"]), np.array([0.0]))
    keys.add(np.array([b"new"]), np.array([10.0]))
    assert len(keys) == 1 and keys.new(np.array([b"old", b"new"])).tolist() == [True, False]
    again = TrainedKeys(5, *keys.arrays())
    assert again.new(np.array([b"new"])).tolist() == [False]
    with pytest.raises(ValueError, match="window"):
        TrainedKeys(0)


def test_many_batches_across_merges_and_longer_keys():
    keys = TrainedKeys(window_s=1e9)
    keys.MERGE_MIN = 8
    seen: set[bytes] = set()
    rng = np.random.default_rng(0)
    for step in range(40):
        batch = np.array([f"r-{int(i)}".encode() * (1 + step // 20) for i in rng.integers(0, 300, 16)])
        expect = []
        for k in batch.tolist():
            expect.append(k not in seen)
            seen.add(k)
        new = keys.new(batch)
        assert new.tolist() == expect, step
        keys.add(batch[new], np.full(int(new.sum()), float(step)))
    assert sorted(keys.arrays()[0].tolist()) == sorted(seen) and len(keys) == len(seen)
