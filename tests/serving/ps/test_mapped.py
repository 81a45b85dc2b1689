"""The serving PS store: a version mapped read-only from its files plus a delta overlay answers
exactly like the training store given the same dump and deltas."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

import model_store as ms
from model_store import shards
from model_store.errors import StoreError
from serving.ps.mapped import MappedTableShard
from serving.ps.shard import TableShard, TableShardConfig
from serving.ps.spec import TableSpec
from serving.ps.table import BucketTable
from tests.serving.ps.helpers import store_config

DIM = 8


def test_table_lookups_equal_a_dict_of_the_same_rows():
    """find/gather (numpy over every candidate of every bucket) against a plain dict: hits,
    misses, empty buckets, float16 rows, tombstones, and leaving misses alone in an overlay."""
    rng = np.random.default_rng(0)
    signs = np.unique(rng.integers(1, 2**63, 5_000, dtype=np.uint64))
    rows = rng.standard_normal((len(signs), DIM)).astype(np.float32)
    ref = dict(zip(signs.tolist(), rows, strict=True))
    query = np.concatenate(
        [signs[rng.integers(0, len(signs), 3_000)], rng.integers(1, 2**63, 1_000, dtype=np.uint64)]
    )
    rng.shuffle(query)
    for dtype in ("float32", "float16"):
        table = BucketTable.build(signs, rows.astype(dtype))
        assert (np.diff(table.buckets.astype(np.int64)) == 0).any()  # some buckets are empty
        out = np.full((len(query), DIM), 7.0, np.float32)
        slots = table.gather(query, out)
        for q, slot, got in zip(query.tolist(), slots, out, strict=True):
            if q in ref:
                assert table.keys[slot] == q
                np.testing.assert_array_equal(got, ref[q].astype(dtype).astype(np.float32))
            else:
                assert slot == -1 and not got.any()
    dead = np.zeros(len(signs), bool)
    dead[::3] = True
    overlay = BucketTable.build(signs, rows, dead)
    out = np.full((len(query), DIM), 7.0, np.float32)
    slots = overlay.gather(query, out, zero_missing=False)
    is_dead = dict(zip(signs.tolist(), dead, strict=True))
    for q, slot, got in zip(query.tolist(), slots, out, strict=True):
        if q not in ref:
            assert slot == -1 and (got == 7.0).all()  # left for the base's row
        elif is_dead[q]:
            assert slot >= 0 and not got.any()
        else:
            np.testing.assert_array_equal(got, ref[q])
    assert (BucketTable.empty(DIM).find(query) == -1).all()
    # the compiled find (this process has numba) and the serving PS's numpy one answer alike
    assert table.find(query).tolist() == table._find_numpy(query).tolist()
    assert table.find(query[:0]).tolist() == [] and (table.find(query) >= 0).sum() == 3_000


def test_a_table_with_signs_upserted_equals_one_built_from_them_all():
    """``upserted`` merges new signs into the bucket order and overwrites present ones: the result
    is the table ``build`` makes of the same final rows (keys, rows, tombstones, directory)."""
    rng = np.random.default_rng(3)
    signs = np.unique(rng.integers(1, 2**63, 4_000, dtype=np.uint64))
    rng.shuffle(signs)
    want: dict[int, tuple[np.ndarray, bool]] = {}
    table = BucketTable.empty(DIM)
    for k in range(5):  # new signs, present ones changed, tombstones set and cleared
        batch = np.unique(
            np.concatenate([signs[k * 700 : (k + 1) * 700], rng.choice(signs[: k * 700 + 1], 200)])
        )
        rows = rng.standard_normal((len(batch), DIM)).astype(np.float32)
        dead = rng.random(len(batch)) < 0.2
        table = table.upserted(batch, rows, dead)
        want.update(zip(batch.tolist(), zip(rows, dead.tolist(), strict=True), strict=True))
        keys = np.array(list(want), np.uint64)
        built = BucketTable.build(
            keys, np.stack([r for r, _ in want.values()]), np.array([d for _, d in want.values()])
        )
        assert table.bits == built.bits and np.array_equal(table.buckets, built.buckets)
        assert sorted(table.keys.tolist()) == sorted(keys.tolist())
        slots = table.find(keys)
        np.testing.assert_array_equal(table.rows[slots], built.rows[built.find(keys)])
        np.testing.assert_array_equal(table.dead[slots], built.dead[built.find(keys)])
    assert table.find(rng.integers(1, 2**63, 100, dtype=np.uint64)).max() == -1


def test_checksum_passes_take_turns_host_wide(tmp_path, monkeypatch):
    """With one slot a second pass waits until the first is done; with two, both run."""
    import fcntl
    import threading

    from serving import priority
    from serving.ps.table import checksum_slot

    entered, waiting = threading.Event(), threading.Event()
    flock = fcntl.flock

    def watched_flock(fd, op):
        if not op & fcntl.LOCK_NB:  # every slot taken: the pass waits for one
            waiting.set()
        return flock(fd, op)

    monkeypatch.setattr(priority.fcntl, "flock", watched_flock)

    def second(slots):
        with checksum_slot(slots, str(tmp_path)):
            entered.set()

    with checksum_slot(1, str(tmp_path)):
        waiter = threading.Thread(target=second, args=(1,))
        waiter.start()
        assert waiting.wait(10)
        assert not entered.is_set()  # it waits while the first pass holds the slot
    assert entered.wait(10)
    waiter.join()
    entered.clear()
    with checksum_slot(2, str(tmp_path)):
        second(2)
        assert entered.is_set()


def _trainer(n: int, seed: int = 0, **kw) -> tuple[TableShard, np.ndarray]:
    rng = np.random.default_rng(seed)
    store = TableShard(store_config(dim=DIM, capacity=4 * n, eviction="lru", **kw))
    signs = np.unique(rng.integers(1, 2**63, n, dtype=np.uint64))
    store.lookup(signs, insert=True)
    store.apply_gradients(signs, rng.standard_normal((len(signs), DIM)).astype(np.float32))
    return store, signs


def _probe(signs: np.ndarray, seed: int = 1) -> np.ndarray:
    absent = np.random.default_rng(seed).integers(1, 2**63, 500, dtype=np.uint64)
    return np.concatenate([signs, absent, signs[:100]])  # duplicates too


def test_a_mapped_version_and_its_delta_overlay_share_one_compiled_find(tmp_path, monkeypatch):
    """The first lookup after the first delta must not compile a kernel on the request's thread:
    the mapped base (read-only), the overlay built in memory (writable) and request signs of
    either kind reach ``bucket_find`` with one argument type, the one the warm-up compiled."""
    import numba

    import serving.ps.index as index

    seen, real = set(), index.bucket_find

    def spy(keys, buckets, signs, bits):
        seen.add(tuple(numba.typeof(a) for a in (keys, buckets, signs)))
        return real(keys, buckets, signs, bits)

    monkeypatch.setattr(index, "bucket_find", spy)
    trainer, signs = _trainer(3_000)
    trainer.version = "7"
    trainer.dump(tmp_path / "full")
    served = MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM)))
    served.open(tmp_path / "full")
    trainer.apply_gradients(signs[:100], np.ones((100, DIM), np.float32))
    trainer.dump_delta(tmp_path / "d0")
    served.apply_delta(tmp_path / "d0")
    assert len(served.served.overlay) and served.served.overlay.keys.flags.writeable
    frozen = signs.copy()
    frozen.flags.writeable = False
    for probe in (signs, frozen, signs[::2]):  # writable, read-only, strided
        np.testing.assert_array_equal(served.lookup(probe)[0], trainer.lookup(probe)[0])
    assert len(seen) == 1, seen


def test_a_mapped_version_plus_deltas_answers_like_the_training_store(tmp_path):
    trainer, signs = _trainer(30_000)
    trainer.version = "7"
    trainer.dump(tmp_path / "full")
    served = MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM)))
    assert served.open(tmp_path / "full") == len(signs)
    assert served.served.base.mapped and not served.served.base.rows.flags.writeable
    probe = _probe(signs)
    np.testing.assert_array_equal(served.lookup(probe)[0], trainer.lookup(probe)[0])
    rng = np.random.default_rng(2)
    for k in range(4):  # changed rows, new rows, deletions, and a deleted sign coming back
        changed = rng.choice(signs, 2_000, replace=False)
        trainer.apply_gradients(changed, rng.standard_normal((2_000, DIM)).astype(np.float32))
        new = rng.integers(1, 2**63, 1_000, dtype=np.uint64)
        trainer.lookup(new, insert=True)
        if k == 1:
            trainer._remove(np.sort(rng.choice(len(trainer), 500, replace=False)))
        if k == 2:
            trainer.assign(signs[:50], np.full((50, DIM), 3.0, np.float32))
        trainer.dump_delta(tmp_path / f"d{k}")
        served.apply_delta(tmp_path / f"d{k}")
        probe = _probe(np.concatenate([signs, new]), seed=k)
        got, got_misses = served.lookup(probe)
        want, want_misses = trainer.lookup(probe)
        np.testing.assert_array_equal(got, want)
        assert got_misses == want_misses
        assert len(served) == len(trainer) and served.delta_seq == trainer.delta_seq
    every = trainer.snapshot().signs
    assert all(s in served for s in every[:200])


def test_deltas_applied_in_one_overlay_build_answer_as_one_at_a_time(tmp_path):
    """A shard loading a version with many deltas builds its overlay once (``with_deltas``); the
    answers are the ones a delta at a time gives: later deltas win, a row beats a deletion of the
    same delta, a deleted sign can come back."""
    trainer, signs = _trainer(5_000)
    trainer.version = "7"
    trainer.dump(tmp_path / "full")
    rng = np.random.default_rng(4)
    deltas = []
    for k in range(6):
        trainer.assign(
            rng.choice(signs, 300, replace=False), rng.standard_normal((300, DIM)).astype(np.float32)
        )
        if k == 2:
            trainer._remove(np.sort(rng.choice(len(trainer), 200, replace=False)))
        if k == 4:  # some deleted signs come back
            trainer.assign(signs[:40], np.full((40, DIM), 5.0, np.float32))
        trainer.dump_delta(tmp_path / f"d{k}")
        deltas.append(tmp_path / f"d{k}")
    one, batch = (MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM))) for _ in range(2))
    for s in (one, batch):
        s.open(tmp_path / "full")
    for d in deltas:
        one.apply_delta(d)
    datas = [batch.read(d, delta=True) for d in deltas]
    with pytest.raises(StoreError, match="does not follow"):  # a gap: nothing applied
        batch.apply_deltas_data([datas[0], *datas[2:]])
    assert batch.delta_seq == one.served.delta_seq - 6
    assert batch.apply_deltas_data(datas[:2]) == sum(len(d.signs) for d in datas[:2])
    assert batch.apply_deltas_data(datas) == sum(len(d.signs) for d in datas[2:])  # the first two skipped
    probe = _probe(signs, seed=9)
    np.testing.assert_array_equal(batch.lookup(probe)[0], one.lookup(probe)[0])
    np.testing.assert_array_equal(batch.lookup(probe)[0], trainer.lookup(probe)[0])
    assert len(batch) == len(one) == len(trainer) and batch.delta_seq == one.delta_seq == trainer.delta_seq


def test_a_dump_of_another_shard_count_is_resharded_in_memory(tmp_path):
    trainer, signs = _trainer(10_000)
    data = trainer.snapshot()
    from features.hashing import shard_of

    owner = shard_of(data.signs, 2)
    for i in range(2):  # the same rows dumped as two shards
        part = data.select(owner == i)
        part.meta = replace(part.meta, shard=i, num_shards=2)
        shards.write_shard(tmp_path / "two", part)
    served = MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM), shard=0, num_shards=1))
    served.open(tmp_path / "two")
    assert not served.served.base.mapped and len(served) == len(signs)
    np.testing.assert_array_equal(served.lookup(signs)[0], trainer.lookup(signs)[0])
    half = MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM), shard=1, num_shards=2))
    half.open(tmp_path / "two")
    assert half.served.base.mapped and len(half) == int((owner == 1).sum())


def test_fp16_rows_are_within_half_precision_of_fp32(tmp_path):
    trainer, signs = _trainer(5_000)
    trainer.dump(tmp_path / "full")
    fp32 = MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM)))
    fp32.open(tmp_path / "full")
    fp16 = MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM, dtype="float16")))
    fp16.open(tmp_path / "full")
    assert fp16.served.base.rows.dtype == np.float16
    assert fp16.memory_bytes < fp32.memory_bytes
    a, b = fp32.lookup(signs)[0], fp16.lookup(signs)[0]
    np.testing.assert_allclose(b, a, rtol=2**-10, atol=1e-7)  # fp16: 10-bit mantissa


def test_a_corrupt_or_truncated_file_is_refused_and_the_served_version_stays(tmp_path):
    trainer, signs = _trainer(5_000)
    trainer.version = "1"
    trainer.dump(tmp_path / "v1")
    trainer.version = "2"
    trainer.dump(tmp_path / "v2")
    served = MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM)))
    served.open(tmp_path / "v1")
    before = served.lookup(signs)[0].copy()
    rows = tmp_path / "v2/shard-0-of-1/rows.npy"
    raw = bytearray(rows.read_bytes())
    raw[-1] ^= 0xFF
    rows.write_bytes(bytes(raw))
    staging = served.staging()
    with pytest.raises(StoreError, match="checksum"):
        staging.open(tmp_path / "v2")
    rows.write_bytes(bytes(raw[:-64]))
    with pytest.raises(StoreError, match="bytes"):
        staging.open(tmp_path / "v2")
    assert served.version == "1"
    np.testing.assert_array_equal(served.lookup(signs)[0], before)


def test_a_bucket_directory_out_of_order_is_refused_though_its_checksum_matches(tmp_path):
    """A dump whose checksums match but whose bucket directory is not monotone (a writer's bug)
    is refused before it serves; so is one whose directory does not end at the row count."""
    import json

    import xxhash

    trainer, signs = _trainer(2_000)
    trainer.version = "1"
    trainer.dump(tmp_path / "v1")
    shard = tmp_path / "v1/shard-0-of-1"
    path = shard / "buckets.npy"
    good = np.load(path)
    swapped, short = good.copy(), good.copy()
    k = int(np.flatnonzero(np.diff(good.astype(np.int64)) > 0)[1])  # a bucket with rows
    swapped[k + 1], swapped[k] = swapped[k], swapped[k + 1]
    short[-1] -= 1
    for bad in (swapped, short):
        np.save(path, bad)
        listing = json.loads((shard / shards.MANIFEST).read_text())
        listing["files"]["buckets.npy"] = {shards.XXH3: xxhash.xxh3_128(path.read_bytes()).hexdigest(),
                                           "bytes": path.stat().st_size}  # fmt: skip
        (shard / shards.MANIFEST).write_text(json.dumps(listing))
        with pytest.raises(StoreError, match="not a directory"):
            BucketTable.open(shard)


def test_a_dump_written_before_xxh3_is_checked_by_its_sha256(tmp_path):
    """Shard files carry XXH3-128 and sha256; a dump with sha256 only (older code) is still
    mapped and checked, and refused when corrupt."""
    import json

    trainer, signs = _trainer(2_000)
    trainer.version = "1"
    trainer.dump(tmp_path / "v1")
    shard = tmp_path / "v1/shard-0-of-1"
    listing = json.loads((shard / shards.MANIFEST).read_text())
    assert all(shards.XXH3 in entry for entry in listing["files"].values())
    for name, entry in listing["files"].items():  # as written before XXH3: sha256 only
        del entry[shards.XXH3]
        entry["sha256"] = ms.sha256_file(shard / name)
    (shard / shards.MANIFEST).write_text(json.dumps(listing))
    served = MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM)))
    served.open(tmp_path / "v1")
    np.testing.assert_array_equal(served.lookup(signs)[0], trainer.lookup(signs)[0])
    raw = bytearray((shard / "signs.npy").read_bytes())
    raw[-1] ^= 0xFF
    (shard / "signs.npy").write_bytes(bytes(raw))
    with pytest.raises(StoreError, match="checksum"):
        served.staging().open(tmp_path / "v1")


def test_a_paced_checksum_matches_one_pass_and_catches_a_flip_in_any_piece():
    """A serving PS's pass hashes in pieces paced to ``VERIFY_DUTY``: it agrees with one call over
    the whole file, and a byte flipped in the first, a middle or the last piece fails it."""
    import hashlib

    import xxhash

    data = np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes()
    for expect in (
        {shards.XXH3: xxhash.xxh3_128(data).hexdigest()},
        {"sha256": hashlib.sha256(data).hexdigest()},
    ):
        assert shards.checksum_ok(data, expect, duty=0.5, chunk=999)
        for i in (0, 5_000, 9_999):
            bad = bytearray(data)
            bad[i] ^= 1
            assert not shards.checksum_ok(bad, expect, duty=0.5, chunk=999)
            assert not shards.checksum_ok(bad, expect)


def test_a_serving_store_refuses_writes(tmp_path):
    served = MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM)))
    with pytest.raises(ValueError, match="does not insert"):
        served.lookup(np.array([1], np.uint64), insert=True)
    with pytest.raises(StoreError, match="read-only"):
        served.apply_gradients(np.array([1], np.uint64), np.zeros((1, DIM), np.float32))
    with pytest.raises(StoreError, match="read-only"):
        served.cut_delta()


def test_an_empty_table_and_a_tiny_one_answer_misses():
    empty = BucketTable.empty(DIM)
    out = np.ones((3, DIM), np.float32)
    assert (empty.gather(np.array([1, 2, 3], np.uint64), out) == -1).all() and not out.any()
    one = BucketTable.build(np.array([42], np.uint64), np.full((1, DIM), 2.0, np.float32))
    assert one.find(np.array([42, 43], np.uint64)).tolist() == [0, -1]


def test_a_switch_keeps_the_replaced_version_for_lookups_that_name_it(tmp_path):
    """Version-pinned lookups: after a switch (checked by a paced pass) both versions answer, each
    from its own rows; the old one is released once no lookup has named it for keep_s; a version
    not held is refused."""
    from serving.rpc.errors import NotServing

    v1, signs = _trainer(5_000, seed=1)
    v1.version = "1"
    v1.dump(tmp_path / "v1")
    v2, _ = _trainer(5_000, seed=1)  # the same signs, other rows
    v2.apply_gradients(signs, np.ones((len(signs), DIM), np.float32))
    v2.version = "2"
    v2.dump(tmp_path / "v2")
    now = [0.0]
    served = MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM)), keep_s=30.0, clock=lambda: now[0])
    assert served.staging().verify_duty == 1.0  # nothing served yet: check at full speed
    served.open(tmp_path / "v1")
    staging = served.staging()
    assert staging.verify_duty == shards.VERIFY_DUTY < 1  # beside a served version: paced
    staging.open(tmp_path / "v2")
    served.adopt(staging)
    assert served.version == "2" and served.held() == [("2", -1), ("1", -1)]
    want1, want2 = v1.lookup(signs)[0], v2.lookup(signs)[0]
    assert not np.array_equal(want1, want2)
    rows, _, answered = served.rows_of(signs, version="1")
    np.testing.assert_array_equal(rows, want1)
    assert answered == ("1", -1)
    np.testing.assert_array_equal(served.lookup(signs, version="2")[0], want2)
    np.testing.assert_array_equal(served.lookup(signs)[0], want2)  # unpinned: the newest
    with pytest.raises(NotServing, match="does not hold version 3 .it holds 2, 1"):
        served.lookup(signs, version="3")
    now[0] = 20.0
    served.lookup(signs[:1], version="1")  # still named: kept 30 s from here
    now[0] = 45.0
    assert served.release_idle() == []
    now[0] = 50.0
    assert served.release_idle() == ["1"] and served.held() == [("2", -1)]
    with pytest.raises(NotServing, match="does not hold version 1"):
        served.lookup(signs, version="1")
    assert served.stats()["held"] == [("2", -1)]


def test_a_released_table_drops_its_pages_and_a_late_lookup_still_reads_the_same_rows(tmp_path):
    """release() drops the mapping's resident pages (madvise through ctypes, off the GIL); a
    lookup still holding the old snapshot faults them back from the file and reads the same rows."""
    import re

    trainer, signs = _trainer(60_000)
    trainer.version = "1"
    trainer.dump(tmp_path / "v1")
    table, _ = BucketTable.open(tmp_path / "v1/shard-0-of-1")
    out = np.empty((len(signs), DIM), np.float32)
    table.gather(signs, out)
    before = out.copy()

    def resident_kb() -> int:  # the mapping of rows.npy in this process
        smaps = Path("/proc/self/smaps").read_text()
        m = re.search(
            re.escape(str(tmp_path / "v1/shard-0-of-1/rows.npy")) + r"\n(?:.*\n)*?Rss:\s+(\d+)", smaps
        )
        return int(m.group(1)) if m else -1

    if Path("/proc/self/smaps").exists():
        assert resident_kb() > 1000
    table.release(pause_s=0)
    if Path("/proc/self/smaps").exists():
        assert resident_kb() < 100
    table.gather(signs, out)
    np.testing.assert_array_equal(out, before)


def test_a_lookup_naming_the_version_a_switch_lands_on_meanwhile_reads_it(tmp_path):
    """``snapshot_for`` reads the served snapshot, then the kept ones: a switch to the named version
    landing between the two reads is answered from the new snapshot, never with no snapshot."""
    v1, signs = _trainer(2_000, seed=1)
    v1.version = "1"
    v1.dump(tmp_path / "v1")
    v1.version = "2"
    v1.dump(tmp_path / "v2")
    served = MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM)))
    served.open(tmp_path / "v1")
    staging = served.staging()
    staging.open(tmp_path / "v2")

    class SwitchOnRead(dict):  # the switch lands while the lookup looks among the kept versions
        def get(self, key, default=None):
            served.adopt(staging)
            return super().get(key, default)

    served.kept = SwitchOnRead()
    rows, _, answered = served.rows_of(signs, version="2")
    assert answered == ("2", -1)
    np.testing.assert_array_equal(rows, v1.lookup(signs)[0])
