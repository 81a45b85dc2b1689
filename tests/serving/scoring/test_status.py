"""The scoring core's statuses: a client's mistake is a 400 naming it wherever it is found (the
scoring core's own schema check, or the worker's INVALID_ARGUMENT passed on with the worker's
message), 503 only when the worker or a shard cannot answer, 500 for the rest. In one process
(an in-process worker) and over a real `recserve worker` process."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

import model_store as ms
from features.codec import encode
from features.schema import schema_from_dict
from features.transform import transform
from serving.ps.client import ShardError
from serving.rpc.errors import NotServing
from serving.scoring.config import ScoringConfig
from serving.scoring.core import BINARY, Scorer
from serving.scoring.decoding import Request
from serving.scoring.errors import LookupFailed, forward_status, status_of
from serving.scoring.loop import score
from serving.worker.core import EmbeddingWorker, InProcessShard
from tests.serving.helpers import DIM, ITEMS, SCHEMA, make_version, remote_scorer

OTHER = schema_from_dict({"name": "other", "slots": [{"name": "a"}, {"name": "b", "kind": "dense"}]})
REQUEST = {"context": {"user": "u1", "hist": "h1|h2", "recent": ""}, "items": ITEMS}


def other_batch():
    """A batch of another schema that names none (schema hash 0): only its shape can tell."""
    batch = transform([{"a": "1", "b": 1.0}], OTHER)
    batch.schema_hash = 0
    return batch


def other_slot_count() -> bytes:
    return encode(other_batch())


def wider_dense() -> bytes:
    """The served schema's batch (its hash and slots) with one dense column too many."""
    batch = transform(REQUEST, SCHEMA)
    batch.dense = np.ones((batch.num_rows, batch.dense.shape[1] + 1), np.float32)
    return encode(batch)


def narrower_dense() -> bytes:
    batch = transform(REQUEST, SCHEMA)
    batch.dense = np.ones((batch.num_rows, 0), np.float32)
    return encode(batch)


BAD_BATCHES = {
    "slot count": (
        other_slot_count,
        f"batch has 1 sparse slots, schema {SCHEMA.name!r} has {len(SCHEMA.sparse)}",
    ),
    "dense too wide": (wider_dense, "batch has 2 dense columns per row"),
    "dense too narrow": (narrower_dense, "batch has 0 dense columns per row"),
}


@pytest.fixture(scope="module")
def scorer(tmp_path_factory):
    """A Scorer of a small version over an in-process worker on that version's rows."""
    from serving.ps.shard import TableShard, TableShardConfig
    from serving.ps.spec import TableSpec

    root = tmp_path_factory.mktemp("store")
    version = make_version(root)
    vdir = ms.version_dir(root, "m", version)
    store = TableShard(TableShardConfig(table=TableSpec(dim=DIM, capacity=10_000)))
    store.open(vdir / "embeddings", version=version)
    s = Scorer(ScoringConfig(str(vdir)), worker=EmbeddingWorker([InProcessShard(store)], SCHEMA))
    yield s
    s.close()


@pytest.mark.parametrize("name", list(BAD_BATCHES))
def test_a_binary_batch_of_another_shape_is_a_400_naming_it(scorer, name):
    make, words = BAD_BATCHES[name]
    status, body, *_ = score(scorer, make(), BINARY)
    assert status == 400, body
    error = orjson.loads(body)["error"]
    assert error.startswith("invalid compact batch: ") and words in error, error
    status, body, *_ = score(scorer, encode(transform(REQUEST, SCHEMA)), BINARY)  # and it keeps scoring
    assert status == 200 and len(orjson.loads(body)["scores"]) == len(ITEMS), body


def test_the_in_process_workers_refusal_is_a_400(scorer):
    with pytest.raises(LookupFailed) as e:
        scorer.lookup(Request(other_batch()))
    status, message = status_of(e.value)
    assert status == 400 and "sparse slots" in message


def test_forward_failures_keep_their_class():
    class Details(Exception):  # what a grpc.RpcError offers
        def details(self):
            return "batch has 1 sparse slots, schema 'x' has 7"

    from_worker = ValueError(
        "worker 127.0.0.1:1: INVALID_ARGUMENT: batch has 1 sparse slots, schema 'x' has 7"
    )
    from_worker.__cause__ = Details()
    assert forward_status(from_worker) == (400, "batch has 1 sparse slots, schema 'x' has 7")
    assert forward_status(NotServing("embedding shard 0 of 1 serves no version: x")) == (
        503,
        "embedding shard 0 of 1 serves no version: x",
    )
    for unavailable in (
        ConnectionError("worker 127.0.0.1:1: UNAVAILABLE: connection refused"),
        ShardError(
            "PS shard 127.0.0.1:2 unavailable: DEADLINE_EXCEEDED", unavailable=True, code="DEADLINE_EXCEEDED"
        ),
    ):
        status, message = forward_status(unavailable)
        assert status == 503 and message.startswith("embedding worker unavailable: "), message
    for broken in (
        RuntimeError("worker 127.0.0.1:1: INTERNAL: boom"),
        ShardError("bad payload", code="INTERNAL"),
    ):
        status, message = forward_status(broken)
        assert status == 500 and message.startswith("embedding worker failed: "), message


@pytest.mark.slow
def test_over_a_worker_process_client_mistakes_are_400_with_the_workers_message(ps_and_worker):
    from model_store.releases import publish
    from serving.rpc.health import wait_serving

    root, ps, worker = ps_and_worker
    version = make_version(root)
    publish(root, "m", version)
    wait_serving(worker.channel, timeout_s=10)
    scorer = remote_scorer(root, version, worker)
    try:
        for name, (make, words) in BAD_BATCHES.items():
            status, body, *_ = score(scorer, make(), BINARY)
            assert status == 400 and words in orjson.loads(body)["error"], (name, body)
        # past the scoring core's own check: the worker's INVALID_ARGUMENT, its message as it is
        with pytest.raises(LookupFailed) as e:
            scorer.lookup(Request(other_batch()))
        assert status_of(e.value) == (
            400,
            f"batch has 1 sparse slots, schema {SCHEMA.name!r} has {len(SCHEMA.sparse)}",
        )
        status, body, *_ = score(scorer, encode(transform(REQUEST, SCHEMA)), BINARY)
        assert status == 200, body
    finally:
        scorer.close()
