"""The typed records of the model store: the version manifest and a shard's meta.json, each
written by its one writer and read back by its one reader, which refuses another format by name,
a missing or unknown field and a value of the wrong type."""

from __future__ import annotations

import json

import numpy as np
import pytest

import model_store as ms
from model_store import RecordError, UnknownFormat, shards
from model_store.manifest import RuntimeChoice, TrainRecord, VersionManifest
from model_store.meta import FORMAT_1, ShardMeta

TABLE = {"dim": 4, "dtype": "float32", "capacity": 100, "optimizer": {"name": "ftrl", "lr": 0.1, "l1": 0.5}}


def _sealed(tmp_path, manifest: VersionManifest):
    staging = ms.staging_dir(tmp_path, manifest.model, manifest.version)
    (staging / "dense").mkdir()
    (staging / "dense" / "model.pt").write_bytes(b"net")
    written = ms.write_manifest(staging, manifest)
    return written, ms.seal(staging, ms.version_dir(tmp_path, manifest.model, manifest.version))


def _full() -> VersionManifest:
    return VersionManifest(
        model="m", version="1", schema_fingerprint="fp", dim=4, num_shards=2, parent=None,
        model_config={"kind": "lr", "num_slots": 3, "num_dense": 2}, dense={"torchscript": "dense/model.pt"},
        dense_runtime=RuntimeChoice("onnx", {"onnx": 0.1, "torchscript": 0.2}, rows=200),
        metrics={"auc": 0.7}, deltas=1, train=TrainRecord({"epochs": 1}, world_size=2, steps=9, plan=None),
    )  # fmt: skip


def test_a_manifest_round_trips_with_its_nested_records_and_checksums(tmp_path):
    written, vdir = _sealed(tmp_path, _full())
    read = ms.read_manifest(vdir)
    assert read == written and read.created > 0
    assert read.files == {"dense/model.pt": ms.file_digest(vdir / "dense/model.pt")}
    assert isinstance(read.dense_runtime, RuntimeChoice) and read.dense_runtime.default == "onnx"
    assert isinstance(read.train, TrainRecord) and read.train.world_size == 2
    assert (read.num_slots, read.num_dense) == (3, 2)
    on_disk = json.loads((vdir / ms.MANIFEST).read_text())
    assert on_disk["schema_fingerprint"] == "fp" and on_disk["num_shards"] == 2  # the old field names


def _rewrite(vdir, change) -> None:
    raw = json.loads((vdir / ms.MANIFEST).read_text())
    change(raw)
    (vdir / ms.MANIFEST).write_text(json.dumps(raw))


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (lambda m: m.update(format=2), UnknownFormat, "version manifest format 2; this recserve reads format 1"),
        (lambda m: m.pop("num_shards"), RecordError, "the version manifest has no 'num_shards' field"),
        (lambda m: m.update(colour="red"), RecordError, r"unknown field\(s\) \['colour'\] in a version manifest"),
        (lambda m: m.update(dim="16"), RecordError, "the version manifest's 'dim' is '16'"),
        (lambda m: m["dense_runtime"].pop("default"), RecordError, "dense_runtime has no 'default' field"),
    ],
)  # fmt: skip
def test_a_manifest_that_is_not_a_valid_record_is_refused_by_name(tmp_path, change, error, message):
    _, vdir = _sealed(tmp_path, _full())
    _rewrite(vdir, change)
    with pytest.raises(error, match=message) as e:
        ms.read_manifest(vdir, verify=False)
    assert str(vdir / ms.MANIFEST) in str(e.value)
    assert isinstance(e.value, ms.CorruptVersion)  # what every caller of read_manifest handles
    assert [i.status for i in ms.list_versions(tmp_path, "m")] == ["corrupt"]


def _meta(**kw) -> ShardMeta:
    return ShardMeta(
        **{"kind": "full", "shard": 1, "num_shards": 2, "table": TABLE, "state": ["z", "n"]} | kw
    )


def _data(meta: ShardMeta) -> shards.ShardData:
    n = 5
    signs = np.arange(1, n + 1, dtype=np.uint64) << np.uint64(20)
    rows = np.ones((n, 4), np.float32)
    state = {k: np.zeros((n, 4), np.float32) for k in meta.state}
    return shards.ShardData(meta, signs, rows, state, np.zeros(n, np.uint32), np.zeros(n, np.uint32))


def test_a_shard_meta_round_trips_through_a_dump(tmp_path):
    meta = _meta(version="3", delta_seq=4, step=7, schema_hash="fp", seed=2)
    path = shards.write_shard(tmp_path, _data(meta))
    read = shards.read_shard(path).meta
    assert read == shards.read_meta(path)
    assert (read.rows, read.deleted, read.format) == (5, 0, shards.FORMAT) and read.bucket_bits is not None
    assert (read.dim, read.dtype, read.optimizer) == (4, "float32", "ftrl")
    assert read.table == TABLE and (read.version, read.delta_seq, read.step, read.seed) == ("3", 4, 7, 2)
    delta = shards.read_shard(
        shards.write_shard(tmp_path / "d", _data(_meta(kind="delta", base_version="3")))
    )
    assert delta.meta.base_version == "3" and delta.meta.bucket_bits is None


def test_a_format_1_shard_meta_reads_as_format_2():
    old = {"format": FORMAT_1, "kind": "full", "shard": 0, "num_shards": 1, "dim": 4, "dtype": "float16",
           "optimizer": {"name": "adagrad", "lr": 0.05}, "init_scale": 0.02, "state": ["sum"], "rows": 3,
           "deleted": 0, "seed": 1, "bucket_bits": 1}  # fmt: skip
    meta = ShardMeta.from_json(json.dumps(old), "x/meta.json")
    assert meta.format == shards.FORMAT and (meta.dim, meta.dtype, meta.optimizer) == (
        4,
        "float16",
        "adagrad",
    )
    assert meta.table == {"dim": 4, "dtype": "float16", "optimizer": {"name": "adagrad", "lr": 0.05},
                          "init_scale": 0.02}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"format": "recserve-ps-shard/9"}, UnknownFormat, "shard meta format 'recserve-ps-shard/9'"),
        ({"shard": None}, RecordError, "the shard meta's 'shard' is None"),
        ({"kind": "half"}, RecordError, "shard meta kind 'half'"),
        ({"table": {"dim": 4}}, RecordError, "table needs dim, dtype and optimizer.name"),
        ({"extra": 1}, RecordError, r"unknown field\(s\) \['extra'\] in a shard meta"),
    ],
)
def test_a_shard_meta_that_is_not_a_valid_record_is_refused_by_name(change, error, message):
    raw = json.loads(_meta().to_json()) | change
    with pytest.raises(error, match=message) as e:
        ShardMeta.from_json(json.dumps(raw), "x/meta.json")
    assert "x/meta.json" in str(e.value) and isinstance(e.value, ms.StoreError)  # a dump's callers catch it
    raw = json.loads(_meta().to_json())
    raw.pop("state")
    with pytest.raises(RecordError, match="the shard meta has no 'state' field"):
        ShardMeta.from_json(json.dumps(raw), "x/meta.json")
