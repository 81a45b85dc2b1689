"""One gate: the PS follower and the controller refuse a version through ``model_store.validate``
(the function ``recserve publish`` runs), count it, and ``recserve versions`` shows the refusal
and what each serving component actually serves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry

import model_store as ms
from model_store.releases import publish, validate
from serving.ps.client import PSClient
from serving.ps.follow import Follower
from serving.ps.mapped import MappedTableShard
from serving.ps.shard import TableShard, TableShardConfig
from serving.ps.spec import TableSpec
from serving.rpc.procs import stop_children
from serving.stack.config import StackConfig
from serving.stack.controller import Controller
from serving.stack.state import StackState, read_state, write_state
from serving.worker.client import WorkerClient
from tests.helpers import ROOT, wait_until
from tests.serving.helpers import DIM, SIGNS, make_rows_version, make_version, spawn_ps_and_worker


def _stack_json(run_dir: Path, root: Path, dense_version: str, **fields) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    config = StackConfig(store=str(root), model="m", run_dir=str(run_dir))
    state = StackState("m", dense_version, str(run_dir), config, dense_version=dense_version, **fields)
    write_state(run_dir, state)


def _refusals(registry: CollectorRegistry, component: str) -> float | None:
    return registry.get_sample_value(
        "recserve_version_refusals_total", {"component": component, "kind": "version"}
    )


def test_the_ps_follower_and_the_controller_refuse_with_the_gates_message(tmp_path):
    root = tmp_path / "store"
    trainer = TableShard(TableShardConfig(table=TableSpec(dim=DIM, capacity=10_000)))
    trainer.lookup(SIGNS, insert=True)
    v1 = make_rows_version(root, trainer)
    publish(root, "m", v1)
    ps_registry = CollectorRegistry()
    served = MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM)))
    follower = Follower(served, root / "m", registry=ps_registry)
    follower.poll()
    assert served.version == v1
    v2 = make_rows_version(root, trainer, fingerprint="another-schema")
    ms.layout.set_current(root, "m", v2)  # forced past publish's gate
    with pytest.raises(ms.SchemaMismatch) as e:
        validate(root, "m", v2, ms.read_manifest(ms.version_dir(root, "m", v1)))
    message = str(e.value)
    assert f"m version {v2} cannot replace the served version {v1}: its feature schema" in message

    follower.poll()
    follower.poll()  # refused once, counted once
    assert served.version == v1 and follower.refusal == f"not switching to version {v2}: {message}"
    assert _refusals(ps_registry, "ps") == 1

    run_dir = tmp_path / "run"
    _stack_json(run_dir, root, v1)
    controller = Controller(run_dir)
    try:
        assert controller.step() is None and controller.step() is None
        assert controller.served == v1
        assert read_state(run_dir).refused == {v2: message}
        assert _refusals(controller.registry, "controller") == 1
    finally:
        controller.close()


@pytest.mark.slow
def test_recserve_versions_shows_what_each_component_serves_and_why_a_version_is_refused(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    v1 = make_version(root)
    publish(root, "m", v1)
    procs, ps_port, worker_port = spawn_ps_and_worker(root, tmp_path)
    try:
        with PSClient(f"127.0.0.1:{ps_port}", timeout_s=5.0) as ps:
            ps.wait_ready(60)
            trainer = TableShard(TableShardConfig(table=TableSpec(dim=DIM, capacity=10_000)))
            trainer.lookup(SIGNS, insert=True)
            v2 = make_rows_version(root, trainer, fingerprint="another-schema")
            ms.layout.set_current(root, "m", v2)  # forced past publish's gate
            wait_until(lambda: ps.stats()["refusal"], 30, "the shard refusing the version")
            assert ps.stats()["version"] == v1
            assert ps.lookup(SIGNS[:3])[0].shape == (3, DIM)  # still serving v1
        run_dir = tmp_path / "run"
        _stack_json(run_dir, root, v1, ps=[f"127.0.0.1:{ps_port}"], worker=f"127.0.0.1:{worker_port}")
        controller = Controller(run_dir)
        controller.step()  # the controller refuses it too, into stack.json
        controller.close()
        with WorkerClient(f"127.0.0.1:{worker_port}", timeout_s=5.0) as worker:  # up before it is asked
            grpc.channel_ready_future(worker.channel).result(timeout=60)
        proc = subprocess.run(
            [sys.executable, "-m", "recserve", "versions", "--store", str(root), "--model", "m",
             "--run-dir", str(run_dir)],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        stop_children(procs)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    why = f"m version {v2} cannot replace the served version {v1}: its feature schema is another-sche"
    lines = out.splitlines()
    row = next(line for line in lines if line.startswith(f"* {v2:>4}"))
    assert row.endswith("refused by ps shard 0, the controller"), out
    assert f"serving (stack in {run_dir}):" in out and f"dense model  version {v1}" in out
    assert f"ps shard 0   127.0.0.1:{ps_port}  version {v1} delta -1" in out
    assert f"refuses: not switching to version {v2}: {why}" in out
    assert f"worker       127.0.0.1:{worker_port}  version" in out
    assert f"controller   refused version {v2}: {why}" in out
