"""The device-independent half of the CUDA runtimes, on the CPU: which bucket a batch runs in, how
it is cut into chunks, the staging buffers (one per bucket, reused, packed for one copy, pinned
only where CUDA is), and that padding up to a bucket and slicing back scores every row as the
model does on the whole batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from model_store.staging import BUCKETS, BucketRun, Buckets, Staging, run_chunks, unpack
from tests.cuda import needs_cuda, without_cuda
from tests.model_store.runtimes.helpers import D, S, inputs, make


@pytest.mark.parametrize(
    ("rows", "bucket"), [(1, 64), (64, 64), (65, 256), (200, 256), (1000, 1024), (2048, 2048)]
)
def test_a_batch_goes_to_the_smallest_bucket_that_holds_it(rows: int, bucket: int) -> None:
    assert BUCKETS == (64, 256, 1024, 2048) and Buckets().of(rows) == bucket


def test_chunks_of_a_batch() -> None:
    b = Buckets()
    assert b.chunks(0) == []
    assert b.chunks(200) == [BucketRun(0, 200, 256)]
    assert b.chunks(5000) == [
        BucketRun(0, 2048, 2048),
        BucketRun(2048, 4096, 2048),
        BucketRun(4096, 5000, 1024),
    ]
    for bad in (0, 2049):
        with pytest.raises(ValueError, match="buckets hold 1 to 2048"):
            b.of(bad)
    for sizes in ((), (8, 4), (4, 4), (0, 4)):
        with pytest.raises(ValueError, match="distinct positive sizes in ascending order"):
            Buckets(sizes)


@given(st.integers(0, 20_000), st.lists(st.integers(1, 3000), min_size=1, max_size=5, unique=True))
def test_chunks_cover_the_batch_in_order_each_in_a_bucket_that_holds_it(rows: int, sizes: list[int]) -> None:
    b = Buckets(tuple(sorted(sizes)))
    chunks = b.chunks(rows)
    assert [c.start for c in chunks] == [0, *(c.stop for c in chunks[:-1])][: len(chunks)]
    assert (chunks[-1].stop if chunks else 0) == rows
    assert all(1 <= c.rows <= c.bucket and c.bucket in b.sizes for c in chunks)
    assert all(c.bucket == b.largest for c in chunks[:-1])  # only the last is padded
    assert not chunks or chunks[-1].bucket == b.of(chunks[-1].rows)


def test_staging_packs_one_reused_buffer_per_bucket() -> None:
    staging = Staging(S, D, 3)
    pooled, dense = inputs(300)
    first = staging.fill(pooled, dense, BucketRun(0, 200, 256))
    assert first.shape == (256, S * D + 3) and first.dtype == torch.float32
    p, d = unpack(first, S, D)
    np.testing.assert_array_equal(p[:200].numpy(), pooled[:200])
    np.testing.assert_array_equal(d[:200].numpy(), dense[:200])
    assert not first[200:].any()  # padding: zeros at first
    again = staging.fill(pooled, dense, BucketRun(100, 250, 256))  # the same buffer, rows 0..150 rewritten
    assert again.data_ptr() == first.data_ptr() and set(staging.buffers) == {256}
    np.testing.assert_array_equal(unpack(again, S, D)[0][:150].numpy(), pooled[100:250])
    np.testing.assert_array_equal(unpack(again, S, D)[0][150:200].numpy(), pooled[150:200])  # left as it was
    staging.fill(pooled, dense, BucketRun(0, 64, 64))
    assert set(staging.buffers) == {64, 256}


@without_cuda
def test_staging_is_not_pinned_without_cuda() -> None:
    staging = Staging(S, D, 3)
    assert not staging.pin and not staging.buffer(64).is_pinned()


@needs_cuda
def test_staging_is_pinned_with_cuda() -> None:
    staging = Staging(S, D, 3)
    assert staging.pin and staging.buffer(64).is_pinned()


@pytest.mark.parametrize("rows", [1, 4, 5, 16, 17, 40])
@pytest.mark.parametrize("num_dense", [3, 0])
def test_padded_chunks_sliced_back_score_as_the_whole_batch(rows: int, num_dense: int) -> None:
    model = make("dlrm", num_dense).eval()
    pooled, dense = inputs(rows, num_dense)
    buckets, staging, seen = Buckets((4, 16)), Staging(S, D, num_dense, pin=False), []

    def forward(buf: torch.Tensor, chunk: BucketRun) -> torch.Tensor:
        seen.append((buf.shape[0], chunk.bucket))
        return model(*unpack(buf, S, D))  # the whole bucket, padding included, as a CUDA graph runs

    with torch.no_grad():
        got = run_chunks(pooled, dense, buckets, staging, forward)
        want = model(torch.from_numpy(pooled), torch.from_numpy(dense)).numpy()
    assert got.shape == (rows,) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert seen == [(c.bucket, c.bucket) for c in buckets.chunks(rows)]
