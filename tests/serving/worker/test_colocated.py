"""Co-located lookups (serving/worker/colocated.py): a scorer maps its version's shard files and
looks rows up in-process, exactly as a PS would answer -- offline scores, pinned versions, deltas
applied live, "never serve nothing" -- and ``lookups auto`` mixes mapped and remote shards."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import model_store as ms
from features import stream
from features.schema import load_schema
from features.transform import transform
from serving.ps.client import ShardError
from serving.scoring.config import ScoringConfig
from serving.scoring.core import Scorer
from serving.worker.colocated import ColocatedShard, has_local_files
from tests.helpers import ps_in_thread, wait_until
from tests.serving.helpers import TEST, scored
from training.follow.cut import DeltaWriter

pytestmark = pytest.mark.slow
SCHEMA = "data/schemas/criteo.yaml"


@pytest.fixture(scope="module")
def store(trained):
    return trained[0]


def test_colocated_scorer_scores_like_offline(store):
    vdir = ms.version_dir(store, "criteo", "1")
    scorer = Scorer(ScoringConfig(str(vdir), lookups="colocated"))
    try:
        assert scorer.lookup_modes == ["colocated", "colocated"]
        scores, versions = scored(scorer)
        offline = np.load(vdir / "eval" / "scores.npy")[: len(scores)]
        assert np.abs(scores - offline).max() <= 1e-6
        assert versions[-1] == {
            "embedding": "1",
            "delta_seq": -1,
            "dense": "1",
            "shards": [["1", -1], ["1", -1]],
        }
    finally:
        scorer.close()


def test_a_published_delta_goes_live_in_the_colocated_shards(store):
    vdir = ms.version_dir(store, "criteo", "1")
    scorer = Scorer(ScoringConfig(str(vdir), lookups="auto", poll_s=0.05))
    try:
        before, versions = scored(scorer)
        writer = DeltaWriter(store, "criteo")
        schema = load_schema(vdir / "schema.yaml")
        signs = transform(stream.read(TEST, schema, limit=400), schema).signs
        new = writer.lookup(signs) * 3.0 + 0.05
        writer.assign(signs, new)
        seq, _, _ = writer.publish()
        wait_until(
            lambda: all(s.version == ("1", seq) for s in scorer.lookups.worker.shards),
            20,
            f"delta {seq} applied",
        )
        after, versions = scored(scorer)
        assert {(v["embedding"], v["delta_seq"]) for v in versions} == {("1", seq)}
        assert np.abs(after - before).max() > 1e-3
        own = scorer.lookups.worker.router.split(np.asarray(signs))[0][
            :50
        ]  # shard 0's signs: the delta's rows
        rows, answered = scorer.lookups.worker.shards[0].rows(np.asarray(signs)[own], False, "1")
        assert answered == ("1", seq) and np.allclose(rows, new[own], atol=1e-6)
    finally:
        scorer.close()


def test_a_pinned_version_the_shard_does_not_hold_is_refused_not_answered(store):
    shard = ColocatedShard(ms.version_dir(store, "criteo", "1"), 0, 2, 16)
    try:
        with pytest.raises(ShardError) as e:
            shard.rows(np.arange(1, 5, dtype=np.uint64), False, "7")
        assert e.value.not_serving and "does not hold version 7" in str(e.value)
        with pytest.raises(ValueError, match="do not insert"):
            shard.rows(np.arange(1, 5, dtype=np.uint64), True)
    finally:
        shard.close()


def test_a_corrupt_version_is_refused_at_once_naming_why(store, tmp_path):
    """A shard whose files fail their checksum is never served: the shard, and a scorer over it,
    refuse to start with the reason (a frontend counts it as a refused version), at once rather
    than after the warm-up's patience."""
    import time

    from model_store.errors import StoreError

    root = tmp_path / "store"
    shutil.copytree(ms.version_dir(store, "criteo", "1"), ms.version_dir(root, "criteo", "1"))
    victim = ms.version_dir(root, "criteo", "1") / "embeddings" / "shard-0-of-2" / "rows.npy"
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(StoreError, match="shard 0 of 2 serves no version: .*checksum mismatch"):
        ColocatedShard(ms.version_dir(root, "criteo", "1"), 0, 2, 16)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="checksum mismatch"):
        Scorer(ScoringConfig(str(ms.version_dir(root, "criteo", "1")), lookups="colocated"))
    assert time.monotonic() - t0 < 30  # not the warm-up's 60 s of retries


def test_colocated_needs_every_shard_here_and_auto_reads_the_missing_one_remotely(store, tmp_path):
    from serving.ps.config import ServingShardConfig
    from serving.rpc.config import ServerConfig

    root = tmp_path / "store"
    vdir = ms.version_dir(root, "criteo", "1")
    shutil.copytree(ms.version_dir(store, "criteo", "1"), vdir)
    (vdir / "embeddings" / "shard-1-of-2" / ms.SUCCESS).unlink()  # shard 1 is not (wholly) on this host
    assert has_local_files(vdir, 0, 2) and not has_local_files(vdir, 1, 2)
    with pytest.raises(ValueError, match=r"shard\(s\) 1 of 2 .* no complete files on this host"):
        Scorer(ScoringConfig(str(vdir), lookups="colocated"))
    # shard 1 served by a PS process following the original store, where it is whole
    cfg = ServingShardConfig(str(ms.model_dir(store, "criteo")), shard=1, num_shards=2, dim=16,
                             server=ServerConfig(grace_s=0.1))  # fmt: skip
    with ps_in_thread(cfg) as address:
        scorer = Scorer(
            ScoringConfig(str(vdir), lookups="auto", ps=["127.0.0.1:1", address], worker_timeout_s=10)
        )
        try:
            assert scorer.lookup_modes == ["colocated", "remote"]
            scores, versions = scored(scorer)
        finally:
            scorer.close()
    reference = Scorer(ScoringConfig(str(ms.version_dir(store, "criteo", "1")), lookups="colocated"))
    try:  # the same version (and deltas) read wholly in-process
        expected, expected_versions = scored(reference)
    finally:
        reference.close()
    assert np.abs(scores - expected).max() <= 1e-6
    assert versions[-1] == expected_versions[-1]


def test_colocated_shards_apply_a_delta_at_its_inotify_event_not_the_poll(store):
    vdir = ms.version_dir(store, "criteo", "1")
    scorer = Scorer(ScoringConfig(str(vdir), lookups="colocated", poll_s=600))  # notices: inotify
    try:
        writer = DeltaWriter(store, "criteo")
        signs = writer.signs()[:20]
        writer.assign(signs, writer.lookup(signs) + 0.5)
        seq, _, _ = writer.publish()
        wait_until(lambda: all(s.version == ("1", seq) for s in scorer.lookups.worker.shards), 20,
                   f"delta {seq} applied at its notice (the poll is 600 s away)")  # fmt: skip
        assert scorer.lookups.notices is not None and scorer.lookups.notices.count("ok") >= 1
    finally:
        scorer.close()


def test_the_version_load_is_logged_at_info_and_each_delta_after_it_at_debug(store, tmp_path, caplog):
    """A TorchServe worker's log lines cost its JVM CPU at the moment a delta's appliers wake: a
    co-located shard says INFO once, at the version's load; routine deltas go to DEBUG."""
    import logging

    root = tmp_path / "store"
    shutil.copytree(ms.model_dir(store, "criteo"), ms.model_dir(root, "criteo"))
    caplog.set_level(logging.DEBUG, logger="recserve.worker.colocated")
    shard = ColocatedShard(ms.version_dir(root, "criteo", "1"), 0, 2, 16, poll_s=3600)
    try:
        loaded = [r for r in caplog.records if r.name == "recserve.worker.colocated"]
        assert [r.levelno for r in loaded] == [logging.INFO] and "version (none) -> 1" in loaded[0].message
        caplog.clear()
        writer = DeltaWriter(root, "criteo")
        signs = writer.signs()[:100]
        writer.assign(signs, writer.lookup(signs) + 0.5)
        seq, _, _ = writer.publish()
        assert any(e.startswith(f"delta {seq}:") for e in shard.poll())
        applied = [r for r in caplog.records if r.name == "recserve.worker.colocated"]
        assert [r.levelno for r in applied] == [logging.DEBUG] and f"delta {seq}:" in applied[0].message
    finally:
        shard.close()


def test_the_first_poll_takes_no_apply_turn_and_the_follow_thread_does(store, monkeypatch):
    """The first poll runs where nothing is served yet, at nice 10 in a TorchServe worker
    (``initialize``): it takes no host apply slot (``Follower.poll(turn=False)``); the follow
    thread's polls, beside requests, do."""
    from serving.ps.follow import Follower

    turns: list[bool] = []
    poll = Follower.poll
    monkeypatch.setattr(Follower, "poll", lambda self, turn=True: turns.append(turn) or poll(self, turn))
    shard = ColocatedShard(ms.version_dir(store, "criteo", "1"), 0, 2, 16, poll_s=0.05)
    try:
        wait_until(lambda: len(turns) >= 2, 30, "the follow thread's first poll")
        assert turns[0] is False and all(turns[1:]), turns
    finally:
        shard.close()
