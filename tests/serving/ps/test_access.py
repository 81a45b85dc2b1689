"""Least privilege on real PS processes over loopback gRPC: a serving PS (`recserve ps-serve`)
refuses Update, UpdateLookup, Assign, Dump and Load whatever the caller sends; a training PS answers them only with its
admin token (none: UNAUTHENTICATED, another: PERMISSION_DENIED) and only for paths under its data
root; a training PS started without a token file refuses every write. Fuzzed payloads to Lookup
and Stats are INVALID_ARGUMENT (never UNKNOWN or INTERNAL) and the shard keeps answering."""

from __future__ import annotations

import collections

import grpc
import numpy as np
import pytest

from recserve.v1 import ps_pb2
from serving.ps.client import PSClient, ShardError
from serving.rpc.auth import new_token_file, token_metadata
from serving.rpc.procs import free_ports, spawn, stop_children
from tests.helpers import fuzz_payloads, raw_call
from tests.serving.helpers import DIM

pytestmark = pytest.mark.slow

SIGNS = np.array([1, 2, 3], np.uint64)


def writes(where) -> dict:
    """A well-formed request of every writing RPC (paths under ``where``)."""
    return {
        "Update": ps_pb2.UpdateRequest(signs=SIGNS.tobytes(), grads=np.ones((3, DIM), "<f4").tobytes()),
        "UpdateLookup": ps_pb2.UpdateLookupRequest(
            update=ps_pb2.UpdateRequest(signs=SIGNS.tobytes(), grads=np.ones((3, DIM), "<f4").tobytes())
        ),
        "Assign": ps_pb2.AssignRequest(signs=SIGNS.tobytes(), rows=np.ones((3, DIM), "<f4").tobytes()),
        "Dump": ps_pb2.DumpRequest(path=str(where / "dumped")),
        "Load": ps_pb2.LoadRequest(path=str(where / "dumped")),
    }


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    """A shard following model m of an empty store (nothing published: it serves no version)."""
    tmp = tmp_path_factory.mktemp("serving")
    (port,) = free_ports(1)
    proc = spawn(["ps-serve", str(tmp / "store" / "m"), "--port", str(port), "--dim", str(DIM)],
                 tmp / "ps.log")  # fmt: skip
    client = PSClient(f"127.0.0.1:{port}", timeout_s=5.0)
    try:
        client.wait_connected(60)
        yield {"client": client, "tmp": tmp}
    finally:
        client.close()
        stop_children([proc])


def _code(client, method: str, payload: bytes, metadata=()) -> tuple[grpc.StatusCode, str]:
    call = raw_call(client.channel, f"/recserve.v1.EmbeddingPS/{method}")
    try:
        call(payload, timeout=5, metadata=metadata)
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def test_a_serving_ps_refuses_every_write_whatever_is_sent(serving, tmp_path):
    c = serving["client"]
    for method, request in writes(tmp_path).items():
        for payload in (request.SerializeToString(), b"", b"\xff garbage \x00"):
            for metadata in ((), token_metadata("any-token")):
                code, details = _code(c, method, payload, metadata)
                assert code == grpc.StatusCode.PERMISSION_DENIED, (method, code, details)
                assert (
                    details
                    == f"{method} is not served by a serving PS (recserve ps-serve): it answers Lookup, Stats"
                )
    assert not (tmp_path / "dumped").exists()
    assert c.stats()["shard"] == 0  # reads stay open
    with pytest.raises(ShardError, match="serves no version"):  # and answer what they can
        c.lookup(SIGNS)


def test_training_writes_need_the_token(training_ps, tmp_path):
    port = training_ps["client"].target
    anonymous = PSClient(port, timeout_s=5.0)
    other = tmp_path / "other.token"
    new_token_file(other)
    wrong = PSClient(port, timeout_s=5.0, token_file=str(other))
    root = training_ps["root"]
    writes = {
        "update": lambda c: c.update(SIGNS, np.ones((3, DIM), np.float32)),
        "update with lookup": lambda c: c.update_lookup(SIGNS, np.ones((3, DIM), np.float32), SIGNS + 100),
        "inserting lookup": lambda c: c.lookup(SIGNS + 100, insert=True),
        "dump": lambda c: c.dump(str(root / "by-anyone")),
        "load": lambda c: c.load(str(root / "by-anyone")),
    }
    for name, write in writes.items():
        with pytest.raises(ShardError) as e:
            write(anonymous)
        assert e.value.code == "UNAUTHENTICATED" and "needs the admin token" in str(e.value), name
        with pytest.raises(ShardError) as e:
            write(wrong)
        assert e.value.code == "PERMISSION_DENIED" and "wrong admin token" in str(e.value), name
    assert not (root / "by-anyone").exists()
    assert anonymous.lookup(SIGNS + 100)[1] == 3  # reads are open, and nothing was inserted
    assert anonymous.stats()["dim"] == DIM

    c = training_ps["client"]  # the token's holder
    before, _ = c.lookup(SIGNS, insert=True)
    assert c.update(SIGNS, np.ones((3, DIM), np.float32)) == 3
    assert not np.array_equal(c.lookup(SIGNS)[0], before)
    assert c.dump(str(root / "by-holder")).path == str(root.resolve() / "by-holder" / "shard-0-of-1")
    assert c.load(str(root / "by-holder")).rows == c.stats()["rows"]
    anonymous.close()
    wrong.close()


def test_paths_outside_the_data_root_are_refused(training_ps, tmp_path):
    c, root = training_ps["client"], training_ps["root"]
    c.lookup(SIGNS, insert=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    link = root / "link-out"
    link.symlink_to(outside)
    escapes = {
        "..": str(root / ".." / "escaped"),
        "relative ..": "../escaped",
        "absolute elsewhere": str(outside / "dump"),
        "symlink out": str(link / "dump"),
    }
    for name, path in escapes.items():
        for verb in ("dump", "load"):
            with pytest.raises(ShardError) as e:
                getattr(c, verb)(path)
            assert e.value.code == "PERMISSION_DENIED", (name, verb)
            assert f"{verb} path {path!r}" in str(e.value) and f"data root {root.resolve()}" in str(e.value)
    assert not list(outside.iterdir()) and not (root.parent / "escaped").exists()
    assert c.dump("relative/dir").path == str(root.resolve() / "relative" / "dir" / "shard-0-of-1")


def test_a_training_ps_without_a_token_file_refuses_every_write(tmp_path):
    (port,) = free_ports(1)
    proc = spawn(
        ["ps", "--port", str(port), "--dim", str(DIM), "--data-root", str(tmp_path)], tmp_path / "ps.log"
    )
    try:
        with PSClient(f"127.0.0.1:{port}", timeout_s=5.0) as c:
            c.wait_ready(60)
            for method, request in writes(tmp_path).items():
                code, details = _code(c, method, request.SerializeToString(), token_metadata("guess"))
                assert code == grpc.StatusCode.PERMISSION_DENIED, details
                assert "this training PS was started without --admin-token-file" in details
            with pytest.raises(ShardError, match="Lookup with insert is off"):
                c.lookup(SIGNS, insert=True)
            assert c.lookup(SIGNS)[1] == 3
    finally:
        stop_children([proc])


def test_fuzzed_lookup_and_stats_are_invalid_argument_and_the_shard_keeps_answering(training_ps):
    c = training_ps["client"]
    valid = {
        "Lookup": ps_pb2.LookupRequest(signs=SIGNS.tobytes(), dtype=2).SerializeToString(),
        "Stats": ps_pb2.StatsRequest().SerializeToString(),
    }
    codes = collections.Counter()
    for method, request in valid.items():
        for payload in fuzz_payloads(request, 300, seed=13):
            code, details = _code(c, method, payload, c.metadata)
            codes[method, code.name] += 1
            assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (method, payload, details)
    assert codes["Lookup", "INVALID_ARGUMENT"] > 100 and codes["Stats", "INVALID_ARGUMENT"] > 50, codes
    rows, _ = c.lookup(SIGNS)
    assert rows.shape == (3, DIM) and training_ps["proc"].poll() is None


def test_assign_sets_rows_and_refuses_bad_input_as_invalid_argument(training_ps):
    """Assign (the trainer writing its replicated tables into the shards): rows and state land;
    a wrong state count, a wrong size, non-finite rows or duplicate signs are INVALID_ARGUMENT
    naming the problem, nothing is written, and the shard keeps answering."""
    c = training_ps["client"]
    signs = np.array([901, 902], np.uint64)
    rows = np.arange(2 * DIM, dtype=np.float32).reshape(2, DIM)
    assert c.assign(signs, rows) == 2
    np.testing.assert_array_equal(c.lookup(signs)[0], rows)
    bad = {
        "state matrices": ps_pb2.AssignRequest(
            signs=signs.tobytes(), rows=rows.tobytes(), state=[rows.tobytes()] * 5
        ),  # fmt: skip
        "": ps_pb2.AssignRequest(signs=signs.tobytes(), rows=rows[:1].tobytes()),
        "finite": ps_pb2.AssignRequest(
            signs=np.array([903, 904], np.uint64).tobytes(), rows=np.full((2, DIM), np.nan, "<f4").tobytes()
        ),  # fmt: skip
        "distinct": ps_pb2.AssignRequest(
            signs=np.array([905, 905], np.uint64).tobytes(), rows=rows.tobytes()
        ),
    }
    for words, request in bad.items():
        code, details = _code(c, "Assign", request.SerializeToString(), c.metadata)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and words in details, (words, details)
    assert c.lookup(np.array([903, 905], np.uint64))[1] == 2  # none of them was written
    np.testing.assert_array_equal(c.lookup(signs)[0], rows)
    assert training_ps["proc"].poll() is None
