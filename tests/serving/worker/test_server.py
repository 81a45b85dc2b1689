"""Two real PS processes and a real `recserve worker` on free loopback ports: Forward over gRPC
against the rows the PS holds, fp16 replies, health, reflection, metrics, every bad input
answered with INVALID_ARGUMENT while the worker keeps serving, UNAVAILABLE while a PS is down
(and recovery once it is back), and a clean exit on SIGTERM."""

from __future__ import annotations

import collections
import signal
import subprocess
import sys
import urllib.request

import grpc
import numpy as np
import pytest
import torch

from features.codec import encode
from features.hashing import shard_of
from features.schema import dump_schema, schema_from_dict
from features.transform import transform
from recserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from serving.ps.client import PSClient
from serving.rpc.auth import new_token_file
from serving.worker.client import WorkerClient
from tests.helpers import free_ports, fuzz_payloads, raw_call, wait_until
from tests.serving.helpers import SCHEMA, ranking_batch, torch_pooled

pytestmark = pytest.mark.slow

DIM = 4


def _spawn(args: list[str], log) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "recserve", *args], stdout=out, stderr=subprocess.STDOUT
        )


def _ps_args(i: int, port: int, token) -> list[str]:
    return ["ps", "--shard", str(i), "--num-shards", "2", "--port", str(port), "--dim", str(DIM)] + [
        "--admin-token-file",
        str(token),
        "--capacity",
        "1000",
        "--init-scale",
        "0.1",
    ]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("worker")
    schema_path = tmp / "schema.yaml"
    schema_path.write_text(dump_schema(SCHEMA))
    ps_ports = free_ports(2)
    port, metrics_port = free_ports(2)
    token = new_token_file(tmp / "admin.token")  # the training shards': the test inserts rows
    procs = {f"ps{i}": _spawn(_ps_args(i, p, token), tmp / f"ps{i}.log") for i, p in enumerate(ps_ports)}
    ps = [PSClient(f"127.0.0.1:{p}", timeout_s=5.0, token_file=str(token)) for p in ps_ports]
    client = WorkerClient(f"127.0.0.1:{port}", timeout_s=10.0)
    try:
        for c in ps:
            c.wait_ready(timeout_s=60)
        addresses = ",".join(f"127.0.0.1:{p}" for p in ps_ports)
        worker_args = ["worker", "--ps", addresses, "--schema", str(schema_path), "--port", str(port)]
        worker_args += ["--metrics-port", str(metrics_port), "--ps-timeout-s", "2"]
        procs["worker"] = _spawn(worker_args, tmp / "worker.log")
        client.wait_ready(timeout_s=60)
        stub = worker_pb2_grpc.EmbeddingWorkerStub(client.channel)
        yield {"procs": procs, "ps": ps, "ps_ports": ps_ports, "client": client, "stub": stub, "tmp": tmp,
               "token": token, "port": port}  # fmt: skip
    finally:
        client.close()
        for c in ps:
            c.close()
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def metrics_url(stack):
    cmd = stack["procs"]["worker"].args
    return f"http://127.0.0.1:{cmd[cmd.index('--metrics-port') + 1]}/metrics"


def ps_rows(stack, signs: np.ndarray, insert: bool = False) -> np.ndarray:
    owner = shard_of(signs, 2)
    out = np.zeros((len(signs), DIM), np.float32)
    for k, c in enumerate(stack["ps"]):
        if (owner == k).any():
            out[owner == k] = c.lookup(signs[owner == k], insert=insert)[0]
    return out


def test_forward_pools_the_rows_the_shards_hold(stack):
    c = stack["client"]
    batch = ranking_batch()
    rows = ps_rows(stack, batch.signs, insert=True)  # as a trainer would
    assert np.abs(rows).sum() > 0
    res = c.forward(encode(batch))
    assert res.pooled.shape == (batch.num_rows, batch.num_slots, DIM)
    ref = torch_pooled(batch, SCHEMA, torch.from_numpy(rows))
    np.testing.assert_allclose(res.pooled, ref.numpy(), rtol=1e-6, atol=1e-7)

    half = c.forward(batch, dtype="float16")  # a CompactBatch is encoded by the client
    np.testing.assert_allclose(half.pooled, res.pooled, atol=1e-3)
    st = c.stats()
    assert st["num_shards"] == 2 and st["dim"] == DIM and st["schema"] == SCHEMA.name


def test_forward_does_not_insert(stack):
    before = [c.stats()["rows"] for c in stack["ps"]]
    res = stack["client"].forward(ranking_batch(user="never-seen-before"))
    assert [c.stats()["rows"] for c in stack["ps"]] == before
    assert (res.pooled[:, 0] == 0).all()  # the unseen user's row is the default zero row


def test_health_reflection_metrics(stack, metrics_url):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channel = stack["client"].channel
    for service in ("", "recserve.v1.EmbeddingWorker"):
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert "recserve.v1.EmbeddingWorker" in names
    stack["client"].forward(ranking_batch())
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    assert "recserve_worker_forward_seconds_count" in text and "recserve_worker_rows_total" in text


def _code(call, request):
    with pytest.raises(grpc.RpcError) as e:
        call(request, timeout=5)
    return e.value.code(), e.value.details()


def test_bad_input_is_answered_and_the_worker_keeps_serving(stack):
    stub, pb = stack["stub"], worker_pb2
    good = encode(ranking_batch())
    other = schema_from_dict({"name": "other", "slots": [{"name": "a"}]})
    cases = [
        (stub.Forward, pb.ForwardRequest(), "empty request"),
        (stub.Forward, pb.ForwardRequest(batch=b"not a batch at all"), "shorter than the 48-byte header"),
        (stub.Forward, pb.ForwardRequest(batch=good[:-8]), "size mismatch"),
        (stub.Forward, pb.ForwardRequest(batch=encode(transform([{"a": "1"}], other))), "schema"),
        (stub.Forward, pb.ForwardRequest(batch=good, dtype=9), "unknown dtype"),
    ]
    for call, request, words in cases:
        code, details = _code(call, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and words in details, (words, details)
    resp = stub.Forward(pb.ForwardRequest(batch=good, dtype=common_pb2.FLOAT32), timeout=5)
    assert resp.num_rows == 4 and stack["procs"]["worker"].poll() is None


def test_fuzzed_forward_is_invalid_argument_and_the_worker_keeps_serving(stack):
    valid = worker_pb2.ForwardRequest(batch=encode(ranking_batch())).SerializeToString()
    call = raw_call(stack["client"].channel, "/recserve.v1.EmbeddingWorker/Forward")
    codes = collections.Counter()
    for payload in fuzz_payloads(valid, 300, seed=7):
        try:
            call(payload, timeout=10)
            codes["OK"] += 1
        except grpc.RpcError as e:
            codes[e.code().name] += 1
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (payload, e.code(), e.details())
    assert codes["INVALID_ARGUMENT"] > 200, codes
    assert stack["client"].forward(ranking_batch()).pooled.shape[0] == 4
    assert stack["procs"]["worker"].poll() is None


def test_ps_down_is_unavailable_then_recovers(stack):
    c, procs = stack["client"], stack["procs"]
    procs["ps1"].send_signal(signal.SIGTERM)
    procs["ps1"].wait(timeout=30)
    with pytest.raises(ConnectionError, match="UNAVAILABLE.*PS shard 127.0.0.1"):
        c.forward(ranking_batch())
    assert c.stats()["num_shards"] == 2  # the worker itself keeps serving
    procs["ps1"] = _spawn(
        _ps_args(1, stack["ps_ports"][1], stack["token"]), stack["tmp"] / "ps1-restarted.log"
    )
    stack["ps"][1].wait_ready(timeout_s=60)

    def answered() -> bool:
        try:
            return c.forward(ranking_batch()).pooled.shape[0] == 4
        except ConnectionError:
            return False

    wait_until(answered, 15, "a forward answered once the shard is back")


def test_sigterm_exits_cleanly(stack):
    proc = stack["procs"]["worker"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
