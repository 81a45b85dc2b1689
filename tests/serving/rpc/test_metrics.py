"""The metrics port: /metrics, and /ready telling a gRPC server's health over plain HTTP (what a
Kubernetes probe reads when the gRPC port speaks TLS)."""

from __future__ import annotations

import urllib.error
import urllib.request

import grpc

from features.schema import dump_schema
from model_store.releases import publish
from serving.ps.shard import TableShard, TableShardConfig
from serving.ps.spec import TableSpec
from serving.rpc.health import check
from serving.rpc.metrics import Readiness, start_metrics_server
from serving.rpc.procs import free_ports, spawn, stop_children
from tests.helpers import wait_until
from tests.serving.helpers import DIM, SCHEMA, SIGNS, make_rows_version


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_ready_is_503_with_the_reason_until_set_and_metrics_stay_served():
    from prometheus_client import CollectorRegistry, Counter

    registry = CollectorRegistry()
    Counter("recserve_test_things", "things", registry=registry).inc()
    readiness = Readiness()
    (port,) = free_ports(1)
    stop = start_metrics_server(port, "127.0.0.1", registry, readiness)
    try:
        base = f"http://127.0.0.1:{port}"
        assert get(f"{base}/ready") == (503, "NOT_SERVING: starting\n")
        readiness.set(True)
        assert get(f"{base}/ready") == (200, "SERVING\n")
        readiness.set(False, "shard 1 is UNAVAILABLE")
        assert get(f"{base}/ready") == (503, "NOT_SERVING: shard 1 is UNAVAILABLE\n")
        readiness.set(False)
        assert get(f"{base}/ready") == (503, "NOT_SERVING: not serving\n")
        status, body = get(f"{base}/metrics")
        assert status == 200 and "recserve_test_things_total 1.0" in body
    finally:
        stop()


def test_a_ps_and_its_worker_say_ready_exactly_when_their_health_says_serving(tmp_path):
    """Nothing published: the follow PS's /ready is 503 naming why, the worker's names its shard;
    a version published: both 200, as their gRPC health turns SERVING."""
    root = tmp_path / "store"
    schema = tmp_path / "schema.yaml"
    schema.write_text(dump_schema(SCHEMA))
    ps_port, ps_metrics, worker_port, worker_metrics = free_ports(4)
    procs = [
        spawn(["ps-serve", str(root / "m"), "--port", str(ps_port), "--metrics-port", str(ps_metrics),
               "--dim", str(DIM), "--poll-s", "0.1"], tmp_path / "ps.log"),
        spawn(["worker", "--ps", f"127.0.0.1:{ps_port}", "--schema", str(schema), "--port", str(worker_port),
               "--metrics-port", str(worker_metrics), "--health-poll-s", "0.1"], tmp_path / "worker.log"),
    ]  # fmt: skip
    ps_ready, worker_ready = (f"http://127.0.0.1:{p}/ready" for p in (ps_metrics, worker_metrics))
    try:

        def answers(url: str, status: int) -> bool:
            try:
                return get(url)[0] == status
            except OSError:  # not listening yet
                return False

        wait_until(lambda: answers(ps_ready, 503) and answers(worker_ready, 503), 60, "both /ready 503")
        assert get(ps_ready)[1] == (
            f"NOT_SERVING: embedding shard 0 of 1 serves no version: no version published yet for model m in {root}\n"
        )
        wait_until(
            lambda: "is NOT_SERVING" in get(worker_ready)[1], 10, "the worker's /ready naming its shard"
        )
        assert get(worker_ready)[1] == f"NOT_SERVING: shard 0 (127.0.0.1:{ps_port}) is NOT_SERVING\n"

        trainer = TableShard(TableShardConfig(table=TableSpec(dim=DIM, capacity=1000)))
        trainer.lookup(SIGNS, insert=True)
        publish(root, "m", make_rows_version(root, trainer))
        wait_until(lambda: answers(ps_ready, 200) and answers(worker_ready, 200), 30, "both /ready 200")
        for port in (ps_port, worker_port):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                assert check(channel, timeout_s=10) == "SERVING"
    finally:
        stop_children(procs)
