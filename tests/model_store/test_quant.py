"""Row-wise int8 (model_store/quant.py) and dumps in a serving dtype (model_store/shards.py):
every element within its row's bound, the layout's size, and one decoding for every reader."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from features.hashing import shard_of
from model_store import shards
from model_store.meta import ShardMeta
from model_store.quant import (
    SERVING_DTYPES,
    StoredRows,
    bytes_per_row,
    dequantize,
    error_bound,
    narrowing,
    quantize,
    register,
    row_codec,
)
from model_store.shards import ShardData, StoreError


def _rows(seed: int, n: int, dim: int, scale: float, offset: float) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)) * scale + offset * scale * rng.standard_normal((n, 1))
    return x.astype(np.float32)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    dim=st.integers(1, 64),
    scale=st.sampled_from([0.0, 1e-7, 1e-5, 1e-3, 0.01, 0.3, 3.0, 30.0]),
    offset=st.sampled_from([0.0, 1.0, 30.0, 300.0]),
)
def test_every_element_is_within_its_rows_bound(seed, dim, scale, offset):
    x = _rows(seed, 300, dim, scale, offset)
    codes, qparams = quantize(x)
    assert codes.dtype == np.uint8 and qparams.dtype == np.float16 and qparams.shape == (300, 2)
    err = np.abs(dequantize(codes, qparams).astype(np.float64) - x).max(axis=1)
    assert (err <= error_bound(x)).all()
    # rows not nearly constant (spread >= half their magnitude: trained embeddings about zero):
    # (max - min) / 510, up to fp16's rounding of the scale
    spread = x.max(axis=1).astype(np.float64) - x.min(axis=1)
    mag = np.abs(x).max(axis=1).astype(np.float64)
    wide = spread >= mag / 2
    assert (err[wide] <= (spread / 510 * (1 + 2**-10) + 3e-8 + mag * 2.0**-23)[wide]).all()


def test_constant_and_zero_rows_decode_exactly_and_out_of_range_rows_are_refused():
    x = np.zeros((3, 4), np.float32)
    x[1] = 0.5
    codes, qparams = quantize(x)
    np.testing.assert_array_equal(dequantize(codes, qparams), x)
    with pytest.raises(ValueError, match="65504"):
        quantize(np.full((1, 4), 1e5, np.float32))
    with pytest.raises(ValueError, match="finite"):
        quantize(np.full((1, 4), np.nan, np.float32))


def test_bytes_per_row_of_each_serving_dtype():
    assert [bytes_per_row(64, d) for d in ("float32", "float16", "int8")] == [256, 128, 68]
    with pytest.raises(ValueError, match="int4"):
        bytes_per_row(16, "int4")


def test_each_row_codec_encodes_what_it_decodes_and_the_registry_refuses_what_it_does_not_hold():
    x = _rows(0, 50, 8, 0.3, 1.0)
    for name in SERVING_DTYPES:
        codec = row_codec(name)
        stored, qparams = codec.encode(x)
        assert stored.dtype == codec.storage and (qparams is not None) == codec.qparams
        assert stored.nbytes + (0 if qparams is None else qparams.nbytes) == 50 * codec.bytes_per_row(8)
        into = codec.decode(stored, qparams, np.empty(x.shape, np.float32))
        np.testing.assert_array_equal(into, StoredRows(name, stored, qparams).decoded())
        assert (np.abs(into - x) <= np.abs(x).max(1, keepdims=True) * 2**-7).all()  # 8 bits or better a row
    # the planner narrows float32 -> float16 -> int8; the version is exported in the narrowest chosen
    assert [c.name for c in narrowing() if c.planned] == ["float32", "float16", "int8"]
    with pytest.raises(ValueError, match="registered twice"):
        register(row_codec("int8"))
    with pytest.raises(ValueError, match="unknown serving dtype 'int4'; choose float32, float16, int8"):
        row_codec("int4")


def _data(n: int = 2_000, dim: int = 8) -> ShardData:
    rng = np.random.default_rng(0)
    signs = np.unique(rng.integers(1, 2**63, n, dtype=np.uint64))
    n = len(signs)
    table = {"dim": dim, "dtype": "float32", "optimizer": {"name": "adagrad"}}
    meta = ShardMeta(kind="full", shard=0, num_shards=1, table=table, state=["sum"], version="1")
    return ShardData(
        meta, signs, (rng.standard_normal((n, dim)) * 0.05).astype(np.float32),
        {"sum": rng.random((n, dim), np.float32)}, np.zeros(n, np.uint32), np.ones(n, np.uint32),
    )  # fmt: skip


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_a_dump_in_a_serving_dtype_round_trips_and_decodes_like_serving(tmp_path, dtype):
    data = _data()
    shards.write_shard(tmp_path / "v", data)
    shards.encode_dump(tmp_path / "v", dtype)
    d = shards.shard_dirs(tmp_path / "v")[0]
    back = shards.read_shard(d)
    assert back.meta.row_dtype == dtype == back.meta.dtype and back.meta.table["dtype"] == "float32"
    assert ((d / "qparams.npy").exists()) == (dtype == "int8")
    order = np.argsort(data.signs)
    got = back.decoded()
    assert got.rows.dtype == np.float32 and not got.meta.row_dtype
    np.testing.assert_array_equal(got.signs[np.argsort(got.signs)], data.signs[order])
    want = data.rows[order]
    if dtype == "int8":
        codes, qparams = quantize(want)
        np.testing.assert_array_equal(got.rows[np.argsort(got.signs)], dequantize(codes, qparams))
    else:
        np.testing.assert_array_equal(
            got.rows[np.argsort(got.signs)], want.astype(np.float16).astype(np.float32)
        )
    np.testing.assert_array_equal(back.state["sum"][np.argsort(back.signs)], data.state["sum"][order])
    with pytest.raises(StoreError, match="already"):
        back.encoded("int8")


def test_an_int8_dump_of_another_shard_count_is_resharded_with_its_scales(tmp_path):
    data = _data()
    owner = shard_of(data.signs, 2)
    for i in range(2):
        part = data.select(owner == i)
        part.meta = replace(part.meta, shard=i, num_shards=2)
        shards.write_shard(tmp_path / "two", part.encoded("int8"))
    one = shards.read_for_shard(tmp_path / "two", 0, 1)
    assert one.qparams is not None and len(one.qparams) == len(data.signs)
    order, want = np.argsort(one.signs), np.argsort(data.signs)
    codes, qparams = quantize(data.rows[want])
    np.testing.assert_array_equal(one.decoded().rows[order], dequantize(codes, qparams))
