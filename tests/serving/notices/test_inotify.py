"""``inotify`` notices (serving/notices/inotify.py): a delta's _SUCCESS and CURRENT, written as the
model store writes them, are notices at once -- also in a version or deltas directory that
appeared after the listener started."""

from __future__ import annotations

import queue

import numpy as np
import pytest

import model_store as ms
from model_store.releases import publish
from serving.notices import Notice, Notices
from serving.ps.shard import TableShard
from tests.serving.helpers import DIM, SIGNS, make_rows_version
from tests.serving.ps.helpers import store_config


@pytest.fixture
def trainer():
    store = TableShard(store_config(dim=DIM, capacity=10_000))
    store.lookup(SIGNS, insert=True)
    return store


def _cut(root, version: str, trainer: TableShard) -> tuple[int, float]:
    trainer.apply_gradients(SIGNS[:10], np.ones((10, DIM), np.float32))
    seq = trainer.delta_seq + 1
    ddir = ms.delta_dir(ms.version_dir(root, "m", version), seq)
    trainer.dump_delta(ddir)
    ms.mark_done(ddir)
    return seq, (ddir / ms.SUCCESS).stat().st_mtime


def _listen(root) -> tuple[Notices, queue.Queue]:
    got: queue.Queue = queue.Queue()
    n = Notices("inotify", root / "m")
    n.subscribe(got.put)
    return n, got


def test_deltas_and_current_are_noticed_as_written(tmp_path, trainer):
    v1 = make_rows_version(tmp_path, trainer)
    publish(tmp_path, "m", v1)
    n, got = _listen(tmp_path)
    try:
        seq, ts = _cut(tmp_path, v1, trainer)  # the version's first delta: its deltas/ dir is new too
        assert got.get(timeout=10) == Notice("m", v1, seq, ts)
        seq, ts = _cut(tmp_path, v1, trainer)
        assert got.get(timeout=10) == Notice("m", v1, seq, ts)
        v2 = make_rows_version(tmp_path, trainer)  # a version sealed after the listener started
        trainer.version = v2
        publish(tmp_path, "m", v2)
        current = got.get(timeout=10)
        assert (current.version, current.delta_seq) == (v2, -1)
        seq, ts = _cut(tmp_path, v2, trainer)
        assert got.get(timeout=10) == Notice("m", v2, seq, ts)
        assert n.count("ok") == 4 and n.count("malformed") == 0
    finally:
        n.close()


def test_a_missing_model_directory_leaves_the_poll(tmp_path, caplog):
    from serving.notices import open_notices

    assert open_notices("inotify", tmp_path / "nothing-yet") is None
    assert "polling only" in caplog.text
