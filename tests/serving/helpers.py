"""The small serving world the serving (and cluster) tests share: a schema with context, multi-valued
and crossed slots, a ranking request over it, the torch reference of pooling, and versions of a
model ``m`` sealed straight into a model store. Constants and plain functions only: the fixtures
built on them are in the conftest.py files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import model_store as ms
from features.batch import FLAG_CONTEXT
from features.codec import decode, encode
from features.schema import dump_schema, schema_from_dict
from features.transform import transform
from serving.ps.shard import TableShard, TableShardConfig
from serving.ps.spec import TableSpec

DIM = 4
TEST = "data/criteo/wide_resdnn_criteo_test.tsv"  # the Criteo split the trained versions are scored on
SIGNS = np.arange(1, 2001, dtype=np.uint64) * np.uint64(7919)

SCHEMA = schema_from_dict(
    {
        "name": "worker-test",
        "label": "y",
        "slots": [
            {"name": "user", "kind": "categorical", "scope": "context"},
            {"name": "hist", "kind": "multi", "scope": "context", "pooling": "mean"},
            {"name": "recent", "kind": "multi", "scope": "context", "pooling": "sum"},
            {"name": "item", "kind": "categorical"},
            {"name": "tags", "kind": "multi", "pooling": "mean"},
            {"name": "cats", "kind": "multi", "pooling": "sum"},
            {"name": "x", "kind": "dense"},
        ],
        "crosses": [{"name": "user_item", "slots": ["user", "item"]}],
    }
)

ITEMS = [
    {"item": "i1", "tags": "t1|t2|t1", "cats": "c1", "x": 1.0},
    {"item": "i2", "tags": "", "cats": "c1|c2", "x": 2.0},
    {"item": "i1", "tags": "t3", "cats": "", "x": 3.0},
    {"item": "i3", "tags": "t2|t3", "cats": "c2|c2|c3", "x": 4.0},
]


def ranking_batch(user: str = "u1", items=ITEMS):
    """A request with a context (context slots stored once) -> a decoded compact batch."""
    request = {"context": {"user": user, "hist": "h1|h2|h1", "recent": ""}, "items": items}
    return decode(encode(transform(request, SCHEMA)))


def bags(batch, s: int):
    """Slot ``s`` as (global sign indices per value, bag offsets, stored rows) for embedding_bag."""
    view = batch.slot(s)
    start = int(batch.sign_splits[s])
    idx = view.values.astype(np.int64) + start
    rows = batch.rows_of(s)
    offsets = view.offsets[:-1].astype(np.int64) if view.offsets is not None else np.arange(rows)
    return idx, offsets, rows


def torch_pooled(batch, schema, weight: torch.Tensor) -> torch.Tensor:
    """The reference: pooled (rows, slots, dim) with torch embedding_bag over a (n_signs, dim) table."""
    cols = []
    for s, feature in enumerate(schema.sparse):
        idx, offsets, _ = bags(batch, s)
        mode = getattr(feature, "pooling", "sum")
        pooled = torch.nn.functional.embedding_bag(
            torch.from_numpy(idx), weight, torch.from_numpy(offsets), mode=mode
        )
        cols.append(pooled.expand(batch.num_rows, -1) if batch.flags[s] & FLAG_CONTEXT else pooled)
    return torch.stack(cols, dim=1)


def make_rows_version(root, trainer: TableShard, fingerprint: str = "fp") -> str:
    """Seal the trainer store's rows (only rows: no schema, no dense network) as the next version
    of model m; the manifest names ``fingerprint`` as its schema."""
    version = ms.next_version(root, "m")
    staging = ms.staging_dir(root, "m", version)
    trainer.dump(staging / "embeddings")
    ms.write_manifest(staging, ms.VersionManifest("m", version, fingerprint, DIM, num_shards=1))
    ms.seal(staging, ms.version_dir(root, "m", version))
    return version


def make_version(root: Path, rows_dim: int = DIM, seed: int = 0) -> str:
    """A complete version of model m: rows of ``rows_dim`` (its manifest says DIM, so another
    ``rows_dim`` is refused by every shard), SCHEMA and a small dense network."""
    from model_store.runtimes import torchscript
    from training.models import ModelConfig, build_model

    trainer = TableShard(TableShardConfig(table=TableSpec(dim=rows_dim, capacity=10_000), seed=seed))
    trainer.lookup(SIGNS, insert=True)
    version = ms.next_version(root, "m")
    staging = ms.staging_dir(root, "m", version)
    trainer.dump(staging / "embeddings")
    (staging / "schema.yaml").write_text(dump_schema(SCHEMA))
    torch.manual_seed(0)
    model_cfg = ModelConfig(kind="lr", num_slots=len(SCHEMA.sparse), dim=DIM, num_dense=len(SCHEMA.dense))
    pooled = np.zeros((2, model_cfg.num_slots, DIM), np.float32)
    torchscript.RUNTIME.write(
        build_model(model_cfg),
        staging / "dense" / "model.pt",
        pooled,
        np.zeros((2, model_cfg.num_dense), np.float32),
    )
    ms.write_manifest(staging, ms.VersionManifest("m", version, SCHEMA.fingerprint, DIM, num_shards=1,
                                                  dense={"torchscript": "dense/model.pt"}))  # fmt: skip
    ms.seal(staging, ms.version_dir(root, "m", version))
    return version


def remote_scorer(root: Path, version: str, worker):
    """A Scorer of model m's ``version`` whose lookups go to the worker process ``worker`` (a
    WorkerClient). These tests check statuses, not latency: the deadline is one a busy CI box
    cannot miss (the default 1 s once expired on the first Forward of a fresh connection: a 503
    for a 400)."""
    from serving.scoring.config import ScoringConfig
    from serving.scoring.core import Scorer

    vdir = ms.version_dir(root, "m", version)
    return Scorer(ScoringConfig(str(vdir), lookups="remote", worker=worker.address, worker_timeout_s=10.0))


def score_all(client, limit=2000, binary=False, schema="data/schemas/criteo.yaml") -> np.ndarray:
    """Scores of the first ``limit`` rows of TEST, 200 a request, through a ScoringClient; every
    reply is a 200 naming the versions that produced it."""
    import orjson

    from serving.scoring.client import requests_from_file

    out = []
    for body, ctype in requests_from_file(TEST, schema, 200, limit, binary):
        status, payload = client.post(body, ctype)
        assert status == 200, payload
        reply = orjson.loads(payload)
        assert set(reply["versions"]) == {"embedding", "delta_seq", "dense", "shards"}
        out.extend(reply["scores"])
    return np.array(out)


def spawn_ps_and_worker(root: Path, tmp_path: Path) -> tuple[list, int, int]:
    """(processes, PS port, worker port): a `recserve ps-serve <root>/m` and a `recserve worker`
    over it on free loopback ports, both checking every 0.1 s (logs in ``tmp_path``). The worker
    waits up to 60 s for the PS, which starts beside it (the 5 s default is a deadline a busy CI
    box can miss). The caller stops the processes (``stop_children``)."""
    from serving.rpc.procs import free_ports, spawn

    schema = tmp_path / "schema.yaml"
    schema.write_text(dump_schema(SCHEMA))
    ps_port, worker_port = free_ports(2)
    procs = [
        spawn(["ps-serve", str(root / "m"), "--shard", "0", "--num-shards", "1", "--port", str(ps_port),
               "--dim", str(DIM), "--poll-s", "0.1"], tmp_path / "ps.log"),
        spawn(["worker", "--ps", f"127.0.0.1:{ps_port}", "--schema", str(schema), "--port", str(worker_port),
               "--health-poll-s", "0.1", "--ps-timeout-s", "60"], tmp_path / "worker.log"),
    ]  # fmt: skip
    return procs, ps_port, worker_port


def scored(
    scorer, limit: int = 400, schema: str = "data/schemas/criteo.yaml"
) -> tuple[np.ndarray, list[dict]]:
    """(scores, the versions of each reply) of the first ``limit`` rows of TEST, 200 a request,
    scored in process by ``scorer`` (a Scorer); every reply is a 200."""
    import orjson

    from serving.scoring.client import requests_from_file
    from serving.scoring.loop import score

    scores, versions = [], []
    for body, ctype in requests_from_file(TEST, schema, 200, limit):
        status, payload, *_ = score(scorer, body, ctype)
        assert status == 200, payload
        reply = orjson.loads(payload)
        scores.extend(reply["scores"])
        versions.append(reply["versions"])
    return np.array(scores), versions


def consume_impressions(bootstrap: str, topic: str, n: int, timeout_s: float = 30.0) -> list:
    """The first ``n`` impressions (``stream.records.Impression``) logged on ``topic``, read from
    its start, each keyed by its request id; failing after ``timeout_s``."""
    import time
    import uuid

    from confluent_kafka import Consumer

    from stream.records import decode_impression

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex, "auto.offset.reset": "earliest",
                  "enable.auto.commit": False})  # fmt: skip
    c.subscribe([topic])
    out: list = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < n and time.monotonic() < deadline:
            for m in c.consume(n - len(out), 0.5):
                if m.error() is None:
                    assert m.key() == decode_impression(m.value()).request_id.encode()
                    out.append(decode_impression(m.value()))
    finally:
        c.close()
    assert len(out) == n, f"{len(out)} of {n} impressions on {topic} within {timeout_s}s"
    return out
