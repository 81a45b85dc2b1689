"""A real PS process (`recserve ps`) on a free loopback port, called over gRPC: lookup, update,
stats, dump/load, health, reflection, metrics, every bad input answered with INVALID_ARGUMENT
while it keeps serving, and a clean exit on SIGTERM."""

from __future__ import annotations

import signal
import urllib.request

import grpc
import numpy as np
import pytest

from recserve.v1 import common_pb2, ps_pb2
from serving.ps.client import ShardError
from tests.serving.helpers import DIM

pytestmark = pytest.mark.slow


def signs(*xs) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


def test_lookup_update_stats(training_ps):
    c = training_ps["client"]
    rows, misses = c.lookup(signs(10, 11, 12))
    assert misses == 3 and not rows.any()
    rows, misses = c.lookup(signs(10, 11, 12, 10), insert=True)
    assert misses == 0 and rows.shape == (4, DIM) and np.abs(rows).max() <= 0.1
    np.testing.assert_array_equal(rows[0], rows[3])
    assert c.update(signs(10, 10, 11), np.ones((3, DIM), np.float32)) == 2
    after, _ = c.lookup(signs(10, 11, 12))
    np.testing.assert_allclose(after[0], rows[0] - 0.5 * 2, rtol=1e-6)  # duplicates summed
    np.testing.assert_allclose(after[1], rows[1] - 0.5, rtol=1e-6)
    np.testing.assert_array_equal(after[2], rows[2])
    half, _ = c.lookup(signs(10, 11), dtype="float16")
    np.testing.assert_allclose(half, after[:2], rtol=1e-3)
    st = c.stats()
    assert st["rows"] >= 3 and st["dim"] == DIM and st["capacity"] == 1000 and st["optimizer"] == "sgd"
    assert st["memory_bytes"] > 0 and st["misses"] >= 3 and st["hits"] >= 3 and st["delta_seq"] == -1


def test_update_lookup_answers_rows_that_hold_its_update(training_ps):
    """One round trip: the rows answered are read after the gradients are applied (SGD at lr 0.5:
    the row moves by -0.5 per unit of gradient), unseen signs are inserted, and a call with only
    one of the two parts does that part."""
    c = training_ps["client"]
    before, _ = c.lookup(signs(20, 21), insert=True)
    rows, (version, seq) = c.update_lookup(signs(20), np.ones((1, DIM), np.float32), signs(21, 20, 22))
    assert rows.shape == (3, DIM) and (version, seq) == ("", -1)
    np.testing.assert_allclose(rows[1], before[0] - 0.5, rtol=1e-6)  # the update, then the read
    np.testing.assert_array_equal(rows[0], before[1])
    assert c.lookup(signs(22))[1] == 0  # inserted
    np.testing.assert_array_equal(c.lookup(signs(21, 20, 22))[0], rows)
    only_update, _ = c.update_lookup(signs(21), np.ones((1, DIM), np.float32), signs())
    assert only_update.shape == (0, DIM)
    np.testing.assert_allclose(c.lookup(signs(21))[0][0], before[1] - 0.5, rtol=1e-6)
    only_lookup, _ = c.update_lookup(signs(), np.empty((0, DIM), np.float32), signs(21))
    np.testing.assert_array_equal(only_lookup, c.lookup(signs(21))[0])


def test_a_bad_half_of_update_lookup_applies_neither(training_ps):
    """Both parts are checked before either runs: NaN gradients or signs that are not whole
    uint64s are INVALID_ARGUMENT, the rows are as they were and nothing was inserted."""
    c = training_ps["client"]
    before, _ = c.lookup(signs(30), insert=True)
    good = ps_pb2.UpdateRequest(signs=signs(30).tobytes(), grads=np.ones((1, DIM), "<f4").tobytes())
    bad_lookup = ps_pb2.LookupRequest(signs=b"\x01" * 12, insert=True)
    nan = ps_pb2.UpdateRequest(signs=signs(30).tobytes(), grads=np.full((1, DIM), np.nan, "<f4").tobytes())
    fresh = ps_pb2.LookupRequest(signs=signs(31).tobytes(), insert=True)
    cases = {
        "multiple of 8": ps_pb2.UpdateLookupRequest(update=good, lookup=bad_lookup),
        "NaN or Inf": ps_pb2.UpdateLookupRequest(update=nan, lookup=fresh),
        "neither update nor lookup": ps_pb2.UpdateLookupRequest(),
        "no signs": ps_pb2.UpdateLookupRequest(update=ps_pb2.UpdateRequest(grads=good.grads), lookup=fresh),
    }
    for message, request in cases.items():
        with pytest.raises(grpc.RpcError) as e:
            c.stub.UpdateLookup(request, timeout=5, metadata=c.metadata)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in e.value.details(), message
    np.testing.assert_array_equal(c.lookup(signs(30))[0], before)
    assert c.lookup(signs(31))[1] == 1  # still unseen


def test_dump_and_load_over_grpc(training_ps):
    c, root = training_ps["client"], training_ps["root"]
    c.lookup(signs(1, 2, 3), insert=True)
    before, _ = c.lookup(signs(1, 2, 3))
    resp = c.dump(str(root / "full"))
    assert resp.path.endswith("shard-0-of-1") and resp.rows == c.stats()["rows"]
    c.update(signs(1), np.ones((1, DIM), np.float32))
    delta = c.dump(str(root / "d0"), delta=True)
    assert delta.rows >= 1
    loaded = c.load(str(root / "full"))
    assert loaded.rows == resp.rows
    np.testing.assert_array_equal(c.lookup(signs(1, 2, 3))[0], before)
    c.load(str(root / "d0"), delta=True)
    assert c.stats()["delta_seq"] == 0
    assert not np.array_equal(c.lookup(signs(1))[0], before[:1])
    with pytest.raises(ShardError) as e:
        c.load(str(root / "missing"))
    assert e.value.code == "FAILED_PRECONDITION" and "no such dump" in str(e.value)


def bad_requests():
    ok = signs(1, 2).tobytes()
    yield "empty lookup", "Lookup", ps_pb2.LookupRequest(), "empty request"
    yield "signs not x8", "Lookup", ps_pb2.LookupRequest(signs=b"\x01" * 12), "multiple of 8"
    yield "unknown dtype", "Lookup", ps_pb2.LookupRequest(signs=ok, dtype=7), "unknown dtype"
    yield "empty update", "Update", ps_pb2.UpdateRequest(), "empty request"
    yield "update signs not x8", "Update", ps_pb2.UpdateRequest(signs=b"\x01" * 9, grads=b""), "multiple of 8"
    short = np.ones((2, DIM - 1), np.float32).tobytes()
    yield "grads wrong shape", "Update", ps_pb2.UpdateRequest(signs=ok, grads=short), "expected"
    nan = np.full((2, DIM), np.nan, np.float32).tobytes()
    yield "NaN grads", "Update", ps_pb2.UpdateRequest(signs=ok, grads=nan), "NaN or Inf"
    inf = np.full((2, DIM), np.inf, np.float32).tobytes()
    yield "Inf grads", "Update", ps_pb2.UpdateRequest(signs=ok, grads=inf), "NaN or Inf"
    yield "empty dump path", "Dump", ps_pb2.DumpRequest(), "path is empty"


@pytest.mark.parametrize(
    "name,method,request_,message", list(bad_requests()), ids=[b[0] for b in bad_requests()]
)
def test_bad_input_is_invalid_argument_and_server_keeps_serving(training_ps, name, method, request_, message):
    c = training_ps["client"]
    with pytest.raises(grpc.RpcError) as e:
        getattr(c.stub, method)(request_, timeout=5, metadata=c.metadata)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details()
    rows, _ = c.lookup(signs(1, 2))
    assert rows.shape == (2, DIM) and training_ps["proc"].poll() is None


def test_deadline_is_honoured(training_ps):
    with pytest.raises(grpc.RpcError) as e:
        big = np.arange(1, 1_000_001, dtype=np.uint64).tobytes()  # 8 MB: cannot make it in 2 ms
        training_ps["client"].stub.Lookup(ps_pb2.LookupRequest(signs=big), timeout=0.002)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert training_ps["client"].lookup(signs(1))[0].shape == (1, DIM)


def test_health_and_reflection(training_ps):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channel = training_ps["client"].channel
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "recserve.v1.EmbeddingPS"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    answers = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name for a in answers for s in a.list_services_response.service}
    assert {"recserve.v1.EmbeddingPS", "grpc.health.v1.Health"} <= names


def test_metrics_endpoint(training_ps):
    training_ps["client"].lookup(signs(5, 6))
    body = (
        urllib.request.urlopen(f"http://127.0.0.1:{training_ps['metrics_port']}/metrics", timeout=5)
        .read()
        .decode()
    )
    for name in ("recserve_ps_lookup_seconds_bucket", "recserve_ps_rows", "recserve_ps_memory_bytes"):
        assert name in body
    for name in ("recserve_ps_misses_total", "recserve_ps_evictions_total"):
        assert name in body


def test_a_shard_out_of_memory_answers_resource_exhausted_and_keeps_its_rows(start_ps):
    from serving.ps.growth import GIB
    from serving.ps.shard import TableShard, TableShardConfig
    from serving.ps.spec import TableSpec
    from serving.worker.core import UpdateError

    limit_gb = (
        TableShard(TableShardConfig(table=TableSpec(dim=DIM))).bytes_for(100) / GIB
    )  # room for 100 rows
    with start_ps("--capacity", "16", "--max-memory-gb", repr(limit_gb)) as p:
        c = p["client"]
        c.lookup(np.arange(1, 61, dtype=np.uint64), insert=True)  # grows 16 -> 60
        before, _ = c.lookup(np.arange(1, 61, dtype=np.uint64))
        with pytest.raises(ShardError) as e:
            c.lookup(np.arange(1000, 1100, dtype=np.uint64), insert=True)
        assert e.value.code == "RESOURCE_EXHAUSTED" and f"max_memory_gb={limit_gb:g}" in str(e.value)
        assert "160 rows" in str(e.value) and "--eviction lru|lfu" in str(e.value)
        # a worker or trainer that called this shard passes the status on, not INTERNAL
        assert e.value.grpc_status == "RESOURCE_EXHAUSTED"
        try:
            raise UpdateError("a background embedding update failed") from e.value
        except UpdateError as wrapped:
            assert wrapped.grpc_status == "RESOURCE_EXHAUSTED"
        rows, misses = c.lookup(np.arange(1, 61, dtype=np.uint64))
        assert misses == 0
        np.testing.assert_array_equal(rows, before)
        st = c.stats()
        assert (st["rows"], st["evictions"], st["expired"], st["grows"]) == (60, 0, 0, 1)
        assert st["memory_bytes"] <= limit_gb * GIB


def test_eviction_flags_reach_the_store_and_are_counted(start_ps, tmp_path):
    with start_ps("--capacity", "50", "--eviction", "lru") as p:
        c = p["client"]
        for i in range(10):
            c.lookup(np.arange(10 * i, 10 * i + 10, dtype=np.uint64) + 1, insert=True)
        st = c.stats()
        assert (st["rows"], st["capacity"], st["evictions"], st["grows"]) == (50, 50, 50, 0)
        body = (
            urllib.request.urlopen(f"http://127.0.0.1:{p['metrics_port']}/metrics", timeout=5).read().decode()
        )
        assert "recserve_ps_evictions_total 50.0" in body and "recserve_ps_grows_total 0.0" in body
    assert "rows evicted (lru at capacity 50)" in (tmp_path / "ps.log").read_text()
    with pytest.raises(SystemExit):
        from recserve.cli import build_parser

        build_parser("ps").parse_args(["ps", "--eviction", "fifo"])


def test_version_in_lookup_response(training_ps):
    resp = training_ps["client"].stub.Lookup(ps_pb2.LookupRequest(signs=signs(1).tobytes()), timeout=5)
    assert resp.dim == DIM and resp.dtype == common_pb2.FLOAT32 and resp.version.delta_seq >= -1


def test_sigterm_shuts_down_cleanly(training_ps):  # last in the module: it stops the shared server
    proc = training_ps["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0, training_ps["log"].read_text()
    assert "shutting down" in training_ps["log"].read_text()


def test_cli_config_yaml_and_flags(tmp_path):
    from recserve import config
    from recserve.cli import build_parser
    from serving.ps.config import TrainingShardConfig

    cfg_file = tmp_path / "ps.yaml"
    cfg_file.write_text(
        "server: {port: 6000}\nstore:\n  table: {dim: 8, capacity: 500, optimizer: {name: ftrl, l1: 0.5}}\n"
    )
    args = build_parser("ps").parse_args(
        [
            "ps",
            "--config",
            str(cfg_file),
            "--shard",
            "1",
            "--num-shards",
            "3",
            "--lr",
            "0.2",
            "--port",
            "7000",
        ]
    )
    cfg = config.from_args(TrainingShardConfig, args)
    assert (cfg.server.host, cfg.server.port, cfg.server.metrics_port) == ("127.0.0.1", 7000, 0)
    assert (cfg.store.shard, cfg.store.num_shards, cfg.store.dim, cfg.store.capacity) == (1, 3, 8, 500)
    assert (cfg.store.optimizer.name, cfg.store.optimizer.l1, cfg.store.optimizer.lr) == ("ftrl", 0.5, 0.2)
