"""Fitted dense statistics belong to the model version, not to the feature schema.

Two versions retrained on different data from the same schema file share the schema fingerprint
(so serving accepts the new one, and a client's compact batches built from the shipped file
decode), while each version's dense network carries its own statistics and its TorchScript and
ONNX exports reproduce its trainer's scores. A version written before (statistics in its
schema.yaml, none in the network) still loads and scores the same.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import orjson
import pytest
import torch
import yaml

import model_store
from features import stream
from features.codec import decode, encode
from features.schema import dump_schema, load_schema, schema_from_dict
from features.stream import ReadOptions
from features.transform import dense_matrix, transform
from model_store import runtimes
from training import data, offline
from training.config import TrainConfig, train_table
from training.models import ModelConfig, build_model
from training.train import train

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "data/schemas/criteo.yaml"
TRAIN = ROOT / "data/criteo/wide_resdnn_criteo_train.tsv"
TEST = ROOT / "data/criteo/wide_resdnn_criteo_test.tsv"


@pytest.fixture(scope="module")
def versions(tmp_path_factory) -> tuple[Path, Path]:
    """Versions 1 and 2 of one model, trained from the shipped schema file on two disjoint
    1,500-row slices of the training split (one epoch each, in-process PS stores)."""
    tmp = tmp_path_factory.mktemp("stats")
    lines = TRAIN.read_text().splitlines(keepends=True)
    out = []
    for i, rows in enumerate((lines[:1500], lines[1500:3000])):
        part = tmp / f"train-{i}.tsv"
        part.write_text("".join(rows))
        cfg = TrainConfig(schema=str(SCHEMA), data=str(part), test=str(TEST), store=str(tmp / "store"),
                          model="criteo", epochs=1, inprocess_ps=True, num_shards=2, table=train_table(capacity=4096),
                          progress=False, curve=str(tmp / f"curve-{i}.svg"))  # fmt: skip
        out.append(Path(train(cfg).version_dir))
    return out[0], out[1]


def _manifest(version: Path) -> model_store.VersionManifest:
    return model_store.read_manifest(version)


def test_retrained_versions_share_the_schema_fingerprint_not_the_stats(versions):
    shipped = load_schema(SCHEMA)
    (m1, m2) = (_manifest(v) for v in versions)
    assert m1.schema_fingerprint == m2.schema_fingerprint == shipped.fingerprint
    for v in versions:  # the version's schema is the file as written: no fitted values in it
        assert load_schema(v / "schema.yaml") == shipped
    c1, c2 = m1.model_config, m2.model_config
    assert len(c1["dense_mean"]) == len(c1["dense_std"]) == len(shipped.dense) == 13
    assert not np.allclose(c1["dense_mean"], c2["dense_mean"])
    assert not np.allclose(c1["dense_std"], c2["dense_std"])
    # the stats are the moments of the first slice's transformed dense features
    schema = load_schema(SCHEMA)
    x = dense_matrix(transform(stream.read(TRAIN, schema, limit=1500), schema), schema).astype(np.float64)
    np.testing.assert_allclose(c1["dense_mean"], x.mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c1["dense_std"], x.std(axis=0), rtol=1e-5)
    # and the publish gate takes version 2 where version 1's schema is served
    assert model_store.validate(versions[1].parent.parent, "criteo", "2", m1)


@pytest.mark.filterwarnings("ignore:.*torch.jit.load. is deprecated:DeprecationWarning")
def test_each_version_carries_its_stats_in_both_exports(versions):
    for v in versions:
        config = _manifest(v).model_config
        want = np.load(v / "eval/scores.npy")
        for fmt in runtimes.EXPORTS:
            got = offline.score(v, TEST, dense_format=fmt)
            assert got.shape == want.shape == (2000,)
            assert np.abs(got - want).max() <= 1e-5, fmt
        buffers = torch.jit.load(str(v / runtimes.get("torchscript").file)).state_dict()
        np.testing.assert_allclose(buffers["dense_mean"].numpy(), config["dense_mean"], rtol=1e-6)
        np.testing.assert_allclose(buffers["dense_std"].numpy(), config["dense_std"], rtol=1e-6)


def test_a_compact_batch_from_the_shipped_schema_file_is_accepted(versions):
    from serving.scoring.client import requests_from_file
    from serving.scoring.config import ScoringConfig
    from serving.scoring.core import BINARY, Scorer
    from serving.scoring.loop import score
    from serving.worker.core import EmbeddingWorker, InProcessShard

    shipped = load_schema(SCHEMA)
    blob = encode(transform(stream.read(TEST, shipped, limit=50), shipped))
    for v in versions:
        served = load_schema(v / "schema.yaml")
        assert decode(blob, schema_hash=served.hash64).num_rows == 50
    # end to end through the scoring core: the binary client of `recserve score --binary`
    v = versions[1]
    stores = offline.load_stores(v, _manifest(v))
    worker = EmbeddingWorker([InProcessShard(s) for s in stores], load_schema(v / "schema.yaml"))
    scorer = Scorer(ScoringConfig(str(v)), worker=worker)
    try:
        scores = []
        for body, ctype in requests_from_file(str(TEST), str(SCHEMA), 200, 400, binary=True):
            assert ctype == BINARY
            status, payload, *_ = score(scorer, body, ctype)
            assert status == 200, payload
            scores.extend(orjson.loads(payload)["scores"])
    finally:
        worker.close()
    assert np.abs(np.array(scores) - np.load(v / "eval/scores.npy")[:400]).max() <= 1e-5


def test_user_written_mean_std_apply_once_then_the_fitted_stats(tmp_path):
    """A slot's own mean/std is the transform's (the client's) standardisation; the fitted
    statistics are measured after it and applied by the network on top of it."""
    schema = schema_from_dict(
        {
            "name": "t",
            "label": "label",
            "slots": [
                {"name": "c", "kind": "categorical"},
                {"name": "a", "kind": "dense", "transform": {"mean": 10.0, "std": 4.0}},
                {"name": "b", "kind": "dense", "transform": {"clip_min": 0, "log1p": True}},
            ],
        }
    )
    raw_a, raw_b = np.array([2.0, 6.0, 10.0, 30.0]), np.array([0.0, 1.0, 3.0, 7.0])
    path = tmp_path / "d.csv"
    path.write_text("label,c,a,b\n" + "".join(f"1,x,{a},{b}\n" for a, b in zip(raw_a, raw_b, strict=True)))

    transformed = dense_matrix(transform(stream.read(path, schema), schema), schema)
    a, b = (raw_a - 10.0) / 4.0, np.log1p(raw_b)  # the schema's transform, once
    np.testing.assert_allclose(transformed, np.stack([a, b], axis=1), rtol=1e-6)

    stats = data.scan(path, schema, ReadOptions(numeric_dense=True)).stats(schema)
    np.testing.assert_allclose(stats["a"], (a.mean(), a.std()), rtol=1e-6)  # measured after it
    np.testing.assert_allclose(stats["b"], (b.mean(), b.std()), rtol=1e-6)

    cfg = ModelConfig(kind="lr", num_slots=1, dim=4, num_dense=2,
                      dense_mean=[stats["a"][0], stats["b"][0]], dense_std=[stats["a"][1], stats["b"][1]])  # fmt: skip
    standardised = build_model(cfg).standardise(torch.from_numpy(transformed)).numpy()
    want = np.stack([(a - a.mean()) / a.std(), (b - b.mean()) / b.std()], axis=1)
    np.testing.assert_allclose(standardised, want, rtol=1e-5, atol=1e-6)
    # the user-written values stay in the schema and its fingerprint, the fitted ones do not
    written = schema_from_dict(yaml.safe_load(dump_schema(schema)))  # as a version's schema.yaml
    assert written.dense[0].transform.mean == 10.0 and written.fingerprint == schema.fingerprint


@pytest.mark.filterwarnings("ignore:.*torch.jit.load. is deprecated:DeprecationWarning")
def test_a_version_written_before_still_loads_and_scores_the_same(versions, tmp_path):
    """Rewrite version 1 the way older code wrote it: the fitted statistics in schema.yaml's dense
    transforms, none in model_config or in the exported network (same weights otherwise)."""
    new = versions[0]
    manifest = _manifest(new)
    config = manifest.model_config
    old = tmp_path / "criteo" / "1"
    shutil.copytree(new, old)

    d = load_schema(SCHEMA).to_dict()
    dense = [s for s in d["slots"] if s["kind"] == "dense"]
    for s, m, sd in zip(dense, config["dense_mean"], config["dense_std"], strict=True):
        s["transform"].update(mean=m, std=sd)
    old_schema = schema_from_dict(d)
    (old / "schema.yaml").write_text(dump_schema(old_schema))

    for shard in old.glob("embeddings/shard-*"):  # the dumps name the schema they were trained with
        _rewrite_json(shard / "meta.json", schema_hash=old_schema.fingerprint)

    old_config = {k: v for k, v in config.items() if k not in ("dense_mean", "dense_std")}
    net = build_model(ModelConfig.from_dict(old_config))
    weights = torch.jit.load(str(new / runtimes.get("torchscript").file)).state_dict()
    net.load_state_dict(
        {k: v for k, v in weights.items() if k not in ("dense_mean", "dense_std")}, strict=False
    )
    assert net.dense_std.eq(1).all()
    pooled = np.zeros((2, net.num_slots, net.dim), np.float32)
    for runtime in runtimes.EXPORTS.values():
        runtime.write(net, old / runtime.file, pooled, np.zeros((2, net.num_dense), np.float32))

    model_store.write_manifest(
        old, replace(manifest, schema_fingerprint=old_schema.fingerprint, model_config=old_config)
    )
    assert "dense_mean" not in json.loads((old / "MANIFEST.json").read_text())["model_config"]

    want = np.load(new / "eval/scores.npy")
    for fmt in runtimes.EXPORTS:
        assert np.abs(offline.score(old, TEST, dense_format=fmt) - want).max() <= 1e-5, fmt


def _rewrite_json(path: Path, **changes) -> None:
    """Change a shard dump's meta.json and its entry in the shard's MANIFEST.json."""
    body = json.dumps(json.loads(path.read_text()) | changes).encode()
    path.write_bytes(body)
    listing = path.parent / "MANIFEST.json"
    m = json.loads(listing.read_text())
    m["files"][path.name] = {"sha256": hashlib.sha256(body).hexdigest(), "bytes": len(body)}
    listing.write_text(json.dumps(m))
