"""Fixtures the serving tests share: a PS following model m with a worker over it (real processes
on free loopback ports); ``trained`` is in tests/conftest.py."""

from __future__ import annotations

import grpc
import pytest

from serving.ps.client import PSClient
from serving.rpc.procs import stop_children
from serving.scoring.core import Scorer
from serving.worker.client import WorkerClient
from tests.serving.helpers import spawn_ps_and_worker


@pytest.fixture
def ps_and_worker(tmp_path, monkeypatch):
    """(store root, PS client, worker client): a `recserve ps-serve <root>/m` (nothing published
    yet: it serves no version) and a `recserve worker` over it, both checking every 0.1 s. A
    Scorer's warm-up is skipped here: it would wait for a served version."""
    root = tmp_path / "store"
    root.mkdir()
    procs, ps_port, worker_port = spawn_ps_and_worker(root, tmp_path)
    ps = PSClient(f"127.0.0.1:{ps_port}", timeout_s=5.0)
    ps.pid = procs[0].pid
    worker = WorkerClient(f"127.0.0.1:{worker_port}", timeout_s=5.0)
    monkeypatch.setattr(Scorer, "warmup", lambda self: None)
    try:
        ps.wait_connected(60)
        grpc.channel_ready_future(worker.channel).result(timeout=60)
        yield root, ps, worker
    finally:
        ps.close()
        worker.close()
        stop_children(procs)
