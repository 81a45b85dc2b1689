"""A PS shard following the model store: versions and deltas applied live, in order, atomically."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest

import model_store as ms
from model_store.releases import publish, rollback
from serving.ps.follow import Follower
from serving.ps.mapped import MappedTableShard
from serving.ps.shard import TableShard, TableShardConfig
from serving.ps.spec import TableSpec
from tests.helpers import wait_until
from tests.serving.helpers import DIM, SIGNS, make_rows_version
from tests.serving.ps.helpers import store_config


def _store(**kw) -> TableShard:
    return TableShard(store_config(dim=DIM, capacity=10_000, **kw))


def cut_delta(root, version: str, trainer: TableShard) -> int:
    seq = trainer.delta_seq + 1
    ddir = ms.delta_dir(ms.version_dir(root, "m", version), seq)
    trainer.dump_delta(ddir)
    ms.mark_done(ddir)
    return seq


@pytest.fixture
def setup(tmp_path):
    trainer = _store()
    trainer.lookup(SIGNS, insert=True)
    v1 = make_rows_version(tmp_path, trainer)
    publish(tmp_path, "m", v1)
    served = MappedTableShard(
        TableShardConfig(table=TableSpec(dim=DIM))
    )  # what a serving PS (ps-serve) holds
    return tmp_path, trainer, v1, served, Follower(served, tmp_path / "m")


def test_follows_current_then_deltas_in_order(setup):
    root, trainer, v1, served, follower = setup
    follower.poll()
    assert served.version == v1 and len(served) == len(SIGNS)
    assert np.array_equal(served.lookup(SIGNS)[0], trainer.lookup(SIGNS)[0])
    for k in range(3):  # three deltas, each moving a different block of rows
        block = SIGNS[k * 100 : (k + 1) * 100]
        trainer.apply_gradients(block, np.full((100, DIM), 1.0, np.float32))
        cut_delta(root, v1, trainer)
    events = follower.poll()
    assert [e.split(":")[0] for e in events] == ["delta 0", "delta 1", "delta 2"]
    assert served.delta_seq == 2
    rows, _, answered = served.rows_of(SIGNS)
    assert np.array_equal(rows, trainer.lookup(SIGNS)[0]) and answered == (v1, 2)


@pytest.mark.parametrize(
    "batch_bytes, overlay, builds",
    # 1 byte a build: the first delta alone (no overlay yet), then its overlay outweighs the rest
    [(1, 0, [1, 3]), (1, len(SIGNS), [4]), (1 << 30, 0, [4])],
    ids=["bounded", "overlay-sized", "one-build"],
)
def test_deltas_read_together_flip_in_builds_of_bounded_bytes(
    setup, monkeypatch, batch_bytes, overlay, builds
):
    """A poll that finds several deltas merges them in builds of ``MERGE_BYTES`` or of the
    overlay's bytes, whichever is larger (a build copies the overlay): memory stays bounded, and
    the rows are the same however the deltas were grouped."""
    from serving.ps import mapped

    root, trainer, v1, served, follower = setup
    follower.poll()
    if overlay:  # a first delta that changes every row: an overlay larger than the deltas after it
        trainer.apply_gradients(SIGNS[:overlay], np.full((overlay, DIM), 0.5, np.float32))
        cut_delta(root, v1, trainer)
        follower.poll()
    for k in range(4):
        trainer.apply_gradients(SIGNS[k * 20 : (k + 1) * 20], np.full((20, DIM), 1.0, np.float32))
        cut_delta(root, v1, trainer)
    built: list[int] = []
    apply = served.apply_deltas_data
    monkeypatch.setattr(served, "apply_deltas_data", lambda ds: built.append(len(ds)) or apply(ds))
    monkeypatch.setattr(mapped, "MERGE_BYTES", batch_bytes)
    assert len(follower.poll()) == 4
    assert built == builds
    rows, _, answered = served.rows_of(SIGNS)
    assert np.array_equal(rows, trainer.lookup(SIGNS)[0]) and answered == (v1, 4 if overlay else 3)


def test_deltas_are_idempotent_and_carry_deletions(setup):
    root, trainer, v1, served, follower = setup
    follower.poll()
    trainer.apply_gradients(SIGNS[:10], np.ones((10, DIM), np.float32))
    trainer._remove(
        np.sort(np.array([trainer_row_at(trainer, s) for s in SIGNS[-5:]]))
    )  # evicted in training
    seq = cut_delta(root, v1, trainer)
    follower.poll()
    after = served.lookup(SIGNS)[0].copy()
    assert all(s not in served for s in SIGNS[-5:]) and len(served) == len(SIGNS) - 5
    served.apply_delta(ms.delta_dir(ms.version_dir(root, "m", v1), seq))  # again: a no-op
    assert np.array_equal(served.lookup(SIGNS)[0], after)


def trainer_row_at(store: TableShard, sign) -> int:
    return int(store._index.find(np.array([sign], np.uint64))[0])


def test_corrupt_delta_refused_and_serving_continues(setup):
    root, trainer, v1, served, follower = setup
    follower.poll()
    before = served.lookup(SIGNS)[0].copy()
    trainer.apply_gradients(SIGNS[:50], np.ones((50, DIM), np.float32))
    seq = cut_delta(root, v1, trainer)
    rows = next(ms.delta_dir(ms.version_dir(root, "m", v1), seq).rglob("rows.npy"))
    rows.write_bytes(rows.read_bytes()[:-8] + b"\x01" * 8)  # flipped bytes: checksum mismatch
    assert follower.poll() == []
    assert served.delta_seq == -1 and np.array_equal(served.lookup(SIGNS)[0], before)


def test_deltas_read_together_stop_at_a_corrupt_one_and_apply_those_before_it(setup):
    """Pending deltas flip in one overlay build; a corrupt one among them is refused, the ones
    before it are applied, the ones after it wait on it (they build on it)."""
    root, trainer, v1, served, follower = setup
    follower.poll()
    applied = None
    for k in range(3):
        trainer.apply_gradients(SIGNS[k * 50 : (k + 1) * 50], np.ones((50, DIM), np.float32))
        seq = cut_delta(root, v1, trainer)
        if k == 0:
            applied = trainer.lookup(SIGNS)[0].copy()
        if k == 1:
            rows = next(ms.delta_dir(ms.version_dir(root, "m", v1), seq).rglob("rows.npy"))
            rows.write_bytes(rows.read_bytes()[:-8] + b"\x01" * 8)
    assert [e.split(":")[0] for e in follower.poll()] == ["delta 0"]
    assert served.delta_seq == 0 and np.array_equal(served.lookup(SIGNS)[0], applied)
    assert follower.versions.is_refused(v1, 1) and "delta 1 of version" in follower.versions.refused[(v1, 1)]


def test_version_without_success_or_other_schema_is_refused(setup):
    root, trainer, v1, served, follower = setup
    follower.poll()
    trainer.apply_gradients(SIGNS[:50], np.ones((50, DIM), np.float32))
    v2 = make_rows_version(root, trainer)
    (ms.version_dir(root, "m", v2) / ms.SUCCESS).unlink()
    ms.layout.set_current(root, "m", v2)  # forced past publish's gate
    assert follower.poll() == [] and served.version == v1
    v3 = make_rows_version(root, trainer, fingerprint="another-schema")
    ms.layout.set_current(root, "m", v3)
    assert follower.poll() == [] and served.version == v1


def test_rollback_restores_the_earlier_rows_exactly(setup):
    root, trainer, v1, served, follower = setup
    follower.poll()
    v1_rows = served.lookup(SIGNS)[0].copy()
    trainer.apply_gradients(SIGNS, np.ones((len(SIGNS), DIM), np.float32))
    v2 = make_rows_version(root, trainer)
    publish(root, "m", v2)
    follower.poll()
    assert served.version == v2 and not np.array_equal(served.lookup(SIGNS)[0], v1_rows)
    assert rollback(root, "m") == v1
    follower.poll()
    assert served.version == v1 and np.array_equal(served.lookup(SIGNS)[0], v1_rows)


def test_a_switch_and_a_release_run_no_garbage_collection(tmp_path):
    """Beside requests a follower gives memory back without a collection: one holds the GIL for
    tens of ms in a process that imported torch (serving/memory.py)."""
    trainer = _store()
    trainer.lookup(SIGNS, insert=True)
    publish(tmp_path, "m", make_rows_version(tmp_path, trainer))
    served = MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM)), keep_s=0.0)
    follower = Follower(served, tmp_path / "m")
    follower.poll()
    trainer.apply_gradients(SIGNS, np.ones((len(SIGNS), DIM), np.float32))
    v2 = make_rows_version(tmp_path, trainer)
    publish(tmp_path, "m", v2)
    collections: list[int] = []
    record = lambda phase, info: collections.append(info["generation"]) if phase == "start" else None  # noqa: E731
    gc.disable()  # only a collection the code asks for counts
    gc.callbacks.append(record)
    try:
        follower.poll()
        released = served.release_idle()
    finally:
        gc.callbacks.remove(record)
        gc.enable()
    assert served.version == v2 and released and collections == []


def test_no_lookup_mixes_old_and_new_rows(tmp_path):
    """While lookups run in a loop, a delta sets every row of the shard to a recognisable value:
    every answer is entirely old or entirely new."""
    trainer = _store(optimizer={"name": "sgd", "lr": 1.0})
    trainer.lookup(SIGNS, insert=True)
    v1 = make_rows_version(tmp_path, trainer)
    publish(tmp_path, "m", v1)
    served = MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM)))
    follower = Follower(served, tmp_path / "m")
    follower.poll()
    old = served.lookup(SIGNS)[0].copy()
    trainer.apply_gradients(SIGNS, trainer.lookup(SIGNS)[0] - 7.0)  # sgd lr 1: every row becomes 7.0
    cut_delta(tmp_path, v1, trainer)
    answers, stop = [], threading.Event()

    def look():
        while not stop.is_set():
            answers.append(served.lookup(SIGNS)[0])

    threads = [threading.Thread(target=look) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: len(answers) >= 2, 30, "lookups running before the delta is applied")
    follower.poll()
    stop.set()
    for t in threads:
        t.join()
    answers.append(served.lookup(SIGNS)[0])
    assert len(answers) > 2
    for rows in answers:
        assert np.array_equal(rows, old) or np.all(rows == 7.0), "a lookup mixed old and new rows"
    assert np.all(answers[-1] == 7.0)


def test_version_with_a_corrupt_shard_file_is_refused(setup):
    root, trainer, v1, served, follower = setup
    follower.poll()
    trainer.apply_gradients(SIGNS[:50], np.ones((50, DIM), np.float32))
    v2 = make_rows_version(root, trainer)
    rows = next((ms.version_dir(root, "m", v2) / "embeddings").rglob("rows.npy"))
    rows.write_bytes(rows.read_bytes()[:-4] + b"\x00\x00\x80\x7f")
    ms.layout.set_current(root, "m", v2)  # forced past publish's gate
    before = served.lookup(SIGNS)[0].copy()
    assert follower.poll() == [] and served.version == v1
    assert np.array_equal(served.lookup(SIGNS)[0], before)


def test_refusal_says_why_current_is_not_served_until_it_is(tmp_path):
    from serving.ps.follow import not_serving_reason

    served = _store()
    follower = Follower(served, tmp_path / "m")
    follower.poll()
    assert served.version == "" and follower.refusal == ""
    assert not_serving_reason(served, follower) == (
        f"embedding shard 0 of 1 serves no version: no version published yet for model m in {tmp_path}"
    )
    wide = TableShard(TableShardConfig(table=TableSpec(dim=8, capacity=100)))
    wide.lookup(SIGNS[:10], insert=True)
    v1 = make_rows_version(tmp_path, wide)  # the manifest says dim 4, the rows are dim 8
    publish(tmp_path, "m", v1)
    follower.poll()
    assert served.version == "" and follower.refusal.startswith(f"not switching to version {v1}: ")
    assert "dim 8 does not match the store's dim 4" in follower.refusal
    assert not_serving_reason(served, follower).endswith(follower.refusal)
    trainer = _store()
    trainer.lookup(SIGNS, insert=True)
    v2 = make_rows_version(tmp_path, trainer)
    publish(tmp_path, "m", v2)
    follower.poll()
    assert served.version == v2 and follower.refusal == "" and not_serving_reason(served, follower) == ""
    ms.layout.set_current(tmp_path, "m", v1)  # CURRENT back on the refused version: v2 keeps serving
    follower.poll()
    assert served.version == v2 and "dim 8" in follower.refusal
    assert not_serving_reason(served, follower) == ""  # it serves (v2): lookups answer
    ms.layout.set_current(tmp_path, "m", v2)
    follower.poll()
    assert follower.refusal == ""
    assert not_serving_reason(served, None) == ""  # not following: serves what it holds


def test_followers_of_a_host_take_turns_applying_deltas(setup, monkeypatch, tmp_path_factory):
    """Every serving process of a host applies a delta at the same moment: a follower applies in
    one of the host's apply slots, and takes one only when it has a delta to apply."""
    import tempfile

    from serving.priority import host_slot
    from serving.ps import follow

    root, trainer, v1, served, follower = setup
    locks = tmp_path_factory.mktemp("locks")
    monkeypatch.setattr(tempfile, "tempdir", str(locks))
    monkeypatch.setattr(follow, "APPLY_SLOTS", 1)
    monkeypatch.setattr(follow, "APPLY_WAIT_S", 60.0)
    asked = threading.Event()
    monkeypatch.setattr(follow, "host_slot", lambda *a, **kw: asked.set() or host_slot(*a, **kw))
    follower.poll()
    with host_slot("apply", 1, str(locks)):  # another applier of this host holds the one slot
        assert follower.poll() == [] and not asked.is_set()  # nothing to apply: no slot wanted
        trainer.apply_gradients(SIGNS[:10], np.ones((10, DIM), np.float32))
        seq = cut_delta(root, v1, trainer)
        polled: list[list[str]] = []
        waiter = threading.Thread(target=lambda: polled.append(follower.poll()))
        waiter.start()
        assert asked.wait(10)  # it asked for a turn ...
        waiter.join(0.5)
        assert waiter.is_alive() and served.delta_seq == -1  # ... which has not come
    waiter.join(10)
    assert [e.split(":")[0] for e in polled[0]] == [f"delta {seq}"] and served.delta_seq == seq
    assert follower.slot_timeouts == 0


def test_a_follower_that_gets_no_turn_applies_anyway_and_counts_it(setup, monkeypatch, tmp_path_factory):
    """A slot holder that stalls delays the others by APPLY_WAIT_S, never stops them, and each
    such pass is a counter on /metrics (``recserve_delta_apply_slot_timeouts_total``)."""
    import tempfile

    from prometheus_client import CollectorRegistry

    from serving.freshness import VisibleCollector
    from serving.priority import host_slot
    from serving.ps import follow

    root, trainer, v1, served, follower = setup
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("locks")))
    monkeypatch.setattr(follow, "APPLY_SLOTS", 1)
    monkeypatch.setattr(follow, "APPLY_WAIT_S", 0.05)
    registry = CollectorRegistry()
    registry.register(VisibleCollector("ps", lambda: [(0, follower)]))

    def timeouts():
        return registry.get_sample_value(
            "recserve_delta_apply_slot_timeouts_total", {"component": "ps", "shard": "0"}
        )

    follower.poll()
    assert timeouts() == 0
    with host_slot("apply", 1):  # held for good by another applier of this host
        trainer.apply_gradients(SIGNS[:10], np.ones((10, DIM), np.float32))
        seq = cut_delta(root, v1, trainer)
        assert [e.split(":")[0] for e in follower.poll()] == [f"delta {seq}"] and served.delta_seq == seq
    assert follower.slot_timeouts == 1 and timeouts() == 1


def test_a_follower_that_serves_nothing_yet_takes_no_turn(setup, monkeypatch, tmp_path_factory):
    """A process loading at low priority (a TorchServe worker's co-located shards, ``initialize``)
    applies the deltas that came during its load without a turn: holding a slot at nice 10 would
    keep the serving followers of the host waiting."""
    import tempfile

    from serving.priority import host_slot
    from serving.ps import follow

    root, trainer, v1, served, follower = setup
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("locks")))
    monkeypatch.setattr(follow, "APPLY_SLOTS", 1)
    monkeypatch.setattr(follow, "APPLY_WAIT_S", 60.0)
    follower.poll(turn=False)
    with host_slot("apply", 1):  # every slot held: a turn would wait a minute
        trainer.apply_gradients(SIGNS[:10], np.ones((10, DIM), np.float32))
        seq = cut_delta(root, v1, trainer)
        t0 = time.monotonic()
        assert [e.split(":")[0] for e in follower.poll(turn=False)] == [f"delta {seq}"]
        assert time.monotonic() - t0 < 30 and served.delta_seq == seq and follower.slot_timeouts == 0


def test_a_serving_follower_switches_versions_in_the_hosts_ps_load_turn(setup, monkeypatch, tmp_path_factory):
    """A PS shard loads a new version beside its lookups in one of the host's "ps-load" turns (the
    scorers' loads, which wait for the PS shards, have turns of their own), with the GIL handed
    over finely; a co-located shard's first load (``turn=False``, inside its scorer's turn) takes
    none."""
    import sys
    import tempfile

    from serving import priority
    from serving.priority import host_slot

    root, trainer, v1, served, follower = setup
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("locks")))
    monkeypatch.setattr(priority, "LOAD_SLOTS", 1)
    seen = []
    switch = follower._switch

    def observed(version):
        with host_slot("ps-load", 1, wait_s=0.05) as other, host_slot("load", 1, wait_s=0.05) as scorers:
            seen.append((other, scorers, sys.getswitchinterval()))
        return switch(version)

    monkeypatch.setattr(follower, "_switch", observed)
    follower.poll(turn=False)
    assert seen[-1][:2] == (True, True) and served.version == v1
    v2 = make_rows_version(root, trainer)
    publish(root, "m", v2)
    follower.poll()
    assert seen[-1] == (False, True, priority.FOLLOW_SWITCH_S) and served.version == v2
