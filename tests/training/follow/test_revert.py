"""Rewinding the served version to its last good delta (the output guard's action) is a delta like
any other: after it, the version with every delta applied holds exactly what it held at the good
delta -- rows changed later written back, rows added later deleted, pending changes dropped."""

from __future__ import annotations

import numpy as np

import model_store as ms
from tests.training.follow.helpers import NAME
from training.follow.cut import DeltaWriter
from training.follow.revert import revert
from training.follow.tables import apply_deltas


def held(vdir, upto: int) -> dict[int, np.ndarray]:
    """Every sign's row in the version with its deltas up to ``upto`` applied, loaded afresh."""
    from serving.ps.shard import TableShard

    out = {}
    for store in DeltaWriter(vdir.parent.parent, NAME).stores:
        fresh = TableShard(store.config)
        fresh.load(vdir / "embeddings")
        fresh.version = store.version
        for seq in ms.list_deltas(vdir, after=fresh.delta_seq):
            if seq <= upto:
                fresh.apply_delta(ms.delta_dir(vdir, seq))
        snap = fresh.snapshot()
        out.update(zip(snap.signs.tolist(), snap.rows, strict=True))
    return out


def test_a_rewind_brings_every_row_back_to_the_good_delta(store):
    writer = DeltaWriter(store, NAME)
    vdir, signs = writer.vdir, writer.signs()
    rng = np.random.default_rng(0)
    writer.assign(signs[:50], rng.normal(size=(50, writer.dim)))
    good, _, _ = writer.publish()  # the good delta
    writer.assign(signs[25:100], rng.normal(size=(75, writer.dim)))  # bad: changes some good rows
    new = np.arange(1, 11, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # rows the version never had
    writer.assign(new, rng.normal(size=(10, writer.dim)))
    writer.publish()
    writer.assign(signs[200:210], rng.normal(size=(10, writer.dim)))  # pending, never published
    before = held(vdir, good)
    done = revert(vdir, writer.stores, good)
    assert (done.to, done.deltas, done.rows, done.deleted) == (good, 1, 75 + 10, 10)
    seq, _, _ = writer.publish()
    assert seq == good + 2
    after = held(vdir, seq)
    assert after.keys() == before.keys() and not set(new.tolist()) & after.keys()
    for k, row in before.items():
        np.testing.assert_array_equal(after[k], row)
    # what the trainer holds now is what serving holds
    live = {}
    for s in writer.stores:
        snap = s.snapshot()
        live.update(zip(snap.signs.tolist(), snap.rows, strict=True))
    assert live.keys() == after.keys()
    assert apply_deltas(vdir, writer.stores) == 0
