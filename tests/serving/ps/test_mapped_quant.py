"""A serving PS shard over a version exported in int8 or float16 (serving/ps/mapped.py,
serving/ps/table.py): mapped as it lies, answering the rows every other reader decodes -- the
training store that loads it, the overlay of its deltas -- at dim + 4 bytes a row for int8."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from features.hashing import shard_of
from model_store import shards
from serving.ps.mapped import MappedTableShard
from serving.ps.shard import TableShard, TableShardConfig
from serving.ps.spec import TableSpec
from serving.ps.table import BucketTable
from tests.serving.ps.helpers import store_config

DIM = 8


def _trainer(n: int) -> tuple[TableShard, np.ndarray]:
    rng = np.random.default_rng(0)
    store = TableShard(store_config(dim=DIM, capacity=4 * n))
    signs = np.unique(rng.integers(1, 2**63, n, dtype=np.uint64))
    store.lookup(signs, insert=True)
    store.apply_gradients(signs, rng.standard_normal((len(signs), DIM)).astype(np.float32))
    return store, signs


def _decoded(path, signs: np.ndarray) -> np.ndarray:
    """The rows of ``signs`` as ``ShardData.decoded`` gives them (zeros for absent signs)."""
    data = shards.read_for_shard(path, 0, 1).decoded()
    out = np.zeros((len(signs), DIM), np.float32)
    pos = {s: i for i, s in enumerate(data.signs.tolist())}
    for k, s in enumerate(signs.tolist()):
        if s in pos:
            out[k] = data.rows[pos[s]]
    return out


@pytest.mark.parametrize("dtype", ["int8", "float16"])
def test_a_version_in_a_serving_dtype_is_mapped_and_answers_its_decoded_rows(tmp_path, dtype):
    trainer, signs = _trainer(20_000)
    trainer.version = "3"
    trainer.dump(tmp_path / "full")
    shards.encode_dump(tmp_path / "full", dtype)
    served = MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM)))
    served.open(tmp_path / "full")
    base = served.served.base
    assert base.mapped and base.dtype == dtype and served.stats()["dtype"] == dtype
    assert served.raw_bytes_per_row == 8 + {"int8": DIM + 4, "float16": 2 * DIM}[dtype]
    probe = np.concatenate([signs, np.arange(1, 300, dtype=np.uint64), signs[:50]])
    got, misses = served.lookup(probe)
    np.testing.assert_array_equal(got, _decoded(tmp_path / "full", probe))
    assert misses == 299
    want = trainer.lookup(signs)[0]
    bound = {"int8": (want.max(1) - want.min(1))[:, None] / 510 * (1 + 2**-10) + 1e-6, "float16": None}[dtype]
    if bound is not None:
        assert (np.abs(got[: len(signs)] - want) <= bound).all()
    # a training store loading the version reads the same rows (follow training, DeltaWriter, offline)
    loaded = TableShard(store_config(dim=DIM, capacity=len(signs)))
    loaded.load(tmp_path / "full")
    np.testing.assert_array_equal(loaded.lookup(probe)[0], got)
    _stored_is_decoded(served, probe, dtype)
    # its deltas, in the same dtype, land in an overlay of that dtype decoded the same way
    rng = np.random.default_rng(1)
    changed = rng.choice(signs, 500, replace=False)
    trainer.apply_gradients(changed, rng.standard_normal((500, DIM)).astype(np.float32))
    trainer.dump_delta(tmp_path / "d0")
    gone = np.setdiff1d(signs[:100], changed)[:20]  # and deletions (an eviction's): tombstones
    data = shards.read_for_shard(tmp_path / "d0", 0, 1)
    data = data.select(~np.isin(data.signs, gone))  # a sign's row in the same delta would win
    data.deleted = gone
    shards.write_shard(tmp_path / "d0", data)
    shards.encode_dump(tmp_path / "d0", dtype)
    served.apply_delta(tmp_path / "d0")
    assert served.served.overlay.dtype == dtype
    delta = _decoded(tmp_path / "d0", changed)
    np.testing.assert_array_equal(served.lookup(changed)[0], delta)
    assert served.delta_seq == 0 and served.lookup(gone) == (pytest.approx(0), len(gone))
    _stored_is_decoded(served, probe, dtype)


def _stored_is_decoded(served: MappedTableShard, probe: np.ndarray, dtype: str) -> None:
    """What a PS sends for a ``stored`` lookup (rows as mapped, overlay over them) decodes to
    exactly the rows it answers decoded, misses and tombstones included."""
    stored, misses, answered = served.stored_rows_of(probe)
    rows, want_misses, want_answered = served.rows_of(probe)
    assert stored.dtype == dtype and (misses, answered) == (want_misses, want_answered)
    np.testing.assert_array_equal(stored.decoded(), rows)


def test_an_int8_version_of_another_shard_count_is_built_in_memory_with_its_scales(tmp_path):
    trainer, signs = _trainer(8_000)
    data = trainer.snapshot()
    owner = shard_of(data.signs, 2)
    for i in range(2):
        part = data.select(owner == i)
        part.meta = replace(part.meta, shard=i, num_shards=2)
        shards.write_shard(tmp_path / "two", part.encoded("int8"))
    one = MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM), shard=0, num_shards=1))
    one.open(tmp_path / "two")
    assert not one.served.base.mapped and one.served.base.dtype == "int8"
    half = MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM), shard=1, num_shards=2))
    half.open(tmp_path / "two")
    mine = signs[shard_of(signs, 2) == 1]
    np.testing.assert_array_equal(half.lookup(mine)[0], one.lookup(mine)[0])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["int8", "float16"])
def test_a_serving_ps_answers_rows_in_the_serving_dtype_over_grpc(tmp_path, dtype):
    """``recserve ps-serve`` of an int8 (float16) version sends the rows as mapped -- dim uint8
    codes and an fp16 scale and bias a row (2 x dim bytes a row) -- and the client decodes them
    to exactly the rows a co-located gather reads; float32 is still answered when asked."""
    import grpc

    import model_store as ms
    from recserve.v1 import common_pb2, ps_pb2, ps_pb2_grpc
    from serving.ps.client import PSClient
    from serving.ps.config import ServingShardConfig
    from serving.rpc.config import ServerConfig
    from tests.helpers import ps_in_thread

    trainer, signs = _trainer(5_000)
    staging = ms.staging_dir(tmp_path, "m", "1")
    trainer.dump(staging / "embeddings")
    shards.encode_dump(staging / "embeddings", dtype)
    ms.write_manifest(staging, ms.VersionManifest("m", "1", "fp", DIM, num_shards=1))
    ms.seal(staging, ms.version_dir(tmp_path, "m", "1"))
    ms.publish(tmp_path, "m", "1")
    colocated = MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM)))
    colocated.open(ms.version_dir(tmp_path, "m", "1") / "embeddings")
    probe = np.concatenate([signs[:3000], np.arange(1, 50, dtype=np.uint64)])
    cfg = ServingShardConfig(str(ms.model_dir(tmp_path, "m")), shard=0, num_shards=1, dim=DIM,
                             server=ServerConfig(port=0, grace_s=0.1))  # fmt: skip
    with ps_in_thread(cfg) as address, PSClient(address, timeout_s=10) as client:
        stub = ps_pb2_grpc.EmbeddingPSStub(grpc.insecure_channel(address))
        resp = stub.Lookup(ps_pb2.LookupRequest(signs=probe.astype("<u8").tobytes(), stored=True), timeout=10)
        assert resp.dtype == {"int8": common_pb2.INT8, "float16": common_pb2.FLOAT16}[dtype]
        assert len(resp.rows) + len(resp.qparams) == len(probe) * {"int8": DIM + 4, "float16": 2 * DIM}[dtype]
        assert resp.misses == 49
        want = colocated.lookup(probe)[0]
        rows, misses = client.lookup(probe)
        assert misses == 49
        np.testing.assert_array_equal(rows, want)
        np.testing.assert_array_equal(client.rows(probe, False)[0], want)
        as_f32, _ = client.lookup(probe, dtype="float32")
        np.testing.assert_array_equal(as_f32, want)
        with pytest.raises(grpc.RpcError) as bad:  # int8 is what a shard stores, not a conversion
            stub.Lookup(ps_pb2.LookupRequest(signs=probe.astype("<u8").tobytes(), dtype=common_pb2.INT8))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stored" in bad.value.details()
        with pytest.raises(grpc.RpcError) as bad:  # a serving shard inserts nothing, asked as stored or not
            stub.Lookup(ps_pb2.LookupRequest(signs=probe.astype("<u8").tobytes(), stored=True, insert=True))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "insert" in bad.value.details()


def test_a_table_carries_its_serving_dtype_by_name_and_refuses_arrays_of_another():
    signs = np.arange(1, 5, dtype=np.uint64)
    codes, qparams = np.zeros((4, DIM), np.uint8), np.zeros((4, 2), np.float16)
    table = BucketTable.build(signs, codes, qparams=qparams, dtype="int8")
    assert table.dtype == "int8" and table.astype(np.float16) is table  # codes stay codes
    assert BucketTable.build(signs, np.zeros((4, DIM), np.float32)).astype(np.float16).dtype == "float16"
    with pytest.raises(ValueError, match="int8 rows are uint8 arrays with qparams; got uint8"):
        BucketTable.build(signs, codes, dtype="int8")
    with pytest.raises(ValueError, match="unknown serving dtype 'uint8'"):
        BucketTable.build(signs, codes)
