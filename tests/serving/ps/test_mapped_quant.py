"""A serving PS shard over a version exported in int8 or float16 (serving/ps/mapped.py,
serving/ps/table.py): mapped as it lies, answering the rows every other reader decodes -- the
training store that loads it, the overlay of its deltas -- at dim + 4 bytes a row for int8."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from features.hashing import shard_of
from model_store import shards
from serving.ps.mapped import MappedStore
from serving.ps.spec import TableSpec
from serving.ps.store import EmbeddingStore, StoreConfig
from tests.serving.ps.helpers import store_config

DIM = 8


def _trainer(n: int) -> tuple[EmbeddingStore, np.ndarray]:
    rng = np.random.default_rng(0)
    store = EmbeddingStore(store_config(dim=DIM, capacity=4 * n))
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
    served = MappedStore(StoreConfig(table=TableSpec(dim=DIM)))
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
    loaded = EmbeddingStore(store_config(dim=DIM, capacity=len(signs)))
    loaded.load(tmp_path / "full")
    np.testing.assert_array_equal(loaded.lookup(probe)[0], got)
    # its deltas, in the same dtype, land in the float32 overlay decoded the same way
    rng = np.random.default_rng(1)
    changed = rng.choice(signs, 500, replace=False)
    trainer.apply_gradients(changed, rng.standard_normal((500, DIM)).astype(np.float32))
    trainer.dump_delta(tmp_path / "d0")
    shards.encode_dump(tmp_path / "d0", dtype)
    served.apply_delta(tmp_path / "d0")
    assert served.served.overlay.rows.dtype == (np.float32 if dtype == "int8" else np.float16)
    delta = _decoded(tmp_path / "d0", changed)
    np.testing.assert_array_equal(served.lookup(changed)[0], delta)
    assert served.delta_seq == 0


def test_an_int8_version_of_another_shard_count_is_built_in_memory_with_its_scales(tmp_path):
    trainer, signs = _trainer(8_000)
    data = trainer.snapshot()
    owner = shard_of(data.signs, 2)
    for i in range(2):
        part = data.select(owner == i)
        part.meta = replace(part.meta, shard=i, num_shards=2)
        shards.write_shard(tmp_path / "two", part.encoded("int8"))
    one = MappedStore(StoreConfig(table=TableSpec(dim=DIM), shard=0, num_shards=1))
    one.open(tmp_path / "two")
    assert not one.served.base.mapped and one.served.base.dtype == "int8"
    half = MappedStore(StoreConfig(table=TableSpec(dim=DIM), shard=1, num_shards=2))
    half.open(tmp_path / "two")
    mine = signs[shard_of(signs, 2) == 1]
    np.testing.assert_array_equal(half.lookup(mine)[0], one.lookup(mine)[0])
