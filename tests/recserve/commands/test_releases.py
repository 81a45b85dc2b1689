"""``recserve publish`` / ``rollback --announce kafka://...``: the new CURRENT is announced on the
model's notice topic (serving/notices/), delta_seq -1, with CURRENT's write time."""

from __future__ import annotations

import queue

import numpy as np

import model_store as ms
from recserve.cli import main
from serving.notices import VERSION, Notices
from serving.ps.shard import TableShard
from tests.serving.helpers import DIM, SIGNS, make_rows_version
from tests.serving.ps.helpers import store_config


def test_publish_and_rollback_announce_the_new_current(kafka, tmp_path):
    trainer = TableShard(store_config(dim=DIM, capacity=10_000))
    trainer.lookup(SIGNS, insert=True)
    v1 = make_rows_version(tmp_path, trainer)
    trainer.apply_gradients(SIGNS[:10], np.ones((10, DIM), np.float32))
    v2 = make_rows_version(tmp_path, trainer)
    spec = f"kafka://{kafka.bootstrap}/{kafka.create_topic('notices-releases', 1)}"
    got: queue.Queue = queue.Queue()
    listener = Notices(spec, tmp_path / "m")
    listener.subscribe(got.put)
    try:
        assert listener.listener.assigned.wait(30), "listener never assigned"
        for argv, version in ((["publish", v1], v1), (["publish", v2], v2), (["rollback"], v1)):
            assert main([*argv, "--store", str(tmp_path), "--model", "m", "--announce", spec]) == 0
            notice = got.get(timeout=20)
            assert (notice.model, notice.version, notice.delta_seq) == ("m", version, VERSION)
            assert notice.ts == (ms.model_dir(tmp_path, "m") / ms.CURRENT).stat().st_mtime
    finally:
        listener.close()
