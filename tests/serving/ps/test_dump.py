"""A full dump of a training shard is written from views of its live arrays (no copy: a copy
doubled the shard's memory -- keys, rows, optimizer state -- at every checkpoint). While it is
written, every change waits and reads go on, so the dump is the shard at the moment it was asked
for. A real gRPC PS on a thread of this process; only the file writer is slowed down (gated), to
hold the dump open, and the servicer's wait for writes is watched, to know the change reached it."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from model_store import shards
from serving.ps import server as ps_server
from serving.ps.client import PSClient
from serving.ps.config import TableShardConfig
from serving.ps.spec import TableSpec
from serving.rpc.auth import new_token_file
from tests.helpers import ps_in_thread

DIM = 4


@contextlib.contextmanager
def training_ps(tmp_path):
    from serving.ps.config import TrainingShardConfig
    from serving.rpc.config import ServerConfig

    token, root = new_token_file(tmp_path / "admin.token"), tmp_path / "root"
    root.mkdir()
    cfg = TrainingShardConfig(admin_token_file=str(token), data_root=str(root), server=ServerConfig(grace_s=0.1),
                              store=TableShardConfig(table=TableSpec(dim=DIM, capacity=1000)))  # fmt: skip
    with ps_in_thread(cfg) as address, PSClient(address, timeout_s=10.0, token_file=str(token)) as client:
        yield client, root


def test_a_full_dump_pauses_changes_not_reads_and_holds_the_rows_asked_for(tmp_path, monkeypatch):
    writing, go_on = threading.Event(), threading.Event()
    write_shard = shards.write_shard

    def gated_write(path, data):
        writing.set()
        assert go_on.wait(30)
        return write_shard(path, data)

    monkeypatch.setattr(shards, "write_shard", gated_write)
    paused = threading.Event()  # a change reached the wait for the dump
    writable = ps_server.EmbeddingPSServicer.writable

    async def watched_writable(self) -> None:
        if writing.is_set():
            paused.set()
        await writable(self)

    monkeypatch.setattr(ps_server.EmbeddingPSServicer, "writable", watched_writable)
    signs = np.array([11, 22, 33], dtype=np.uint64)
    with training_ps(tmp_path) as (client, root), ThreadPoolExecutor(2) as pool:
        client.lookup(signs, insert=True)
        before, _ = client.lookup(signs)
        dump = pool.submit(client.dump, str(root / "full"))
        assert writing.wait(10)
        update = pool.submit(client.update, signs, np.ones((3, DIM), np.float32))
        assert paused.wait(10)
        assert not update.done()  # the change waits for the dump ...
        rows, _ = client.lookup(signs)  # ... a read does not
        np.testing.assert_array_equal(rows, before)
        go_on.set()
        dump.result(10)
        assert update.result(10) == 3
        after, _ = client.lookup(signs)
        assert not np.array_equal(after, before)
        data = shards.read_shard(root / "full" / "shard-0-of-1")
        order = np.argsort(data.signs)
        np.testing.assert_array_equal(data.signs[order], signs)
        np.testing.assert_array_equal(data.rows[order], before)  # the rows when it was asked for
