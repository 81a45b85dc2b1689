import numpy as np
import pytest

from features.hashing import SIGN_BITS
from features.kernels import LOG1P_DOMAIN, NOT_FINITE, _radix_sort, dedup_slots, dedup_spans, dense_columns


def _reference(signs, value_counts, rank):
    """np.unique and a bincount: what dedup_slots computes in one pass."""
    uniq, inverse = np.unique(signs, return_inverse=True)
    slot_of = rank[(uniq >> np.uint64(SIGN_BITS)).astype(np.int64)]
    counts = np.bincount(slot_of, minlength=len(value_counts))
    starts = np.cumsum(counts) - counts
    return uniq, inverse - np.repeat(starts, value_counts), counts


@pytest.mark.parametrize(("values", "distinct"), [(5200, 2000), (3, 1), (1, 1), (100_000, 90_000)])
def test_dedup_slots_is_unique_with_inverse_per_slot(values, distinct):
    rng = np.random.default_rng(values)
    ids = np.array([1, 2, 5, 9, 300])  # ascending, with gaps
    rank = np.zeros(ids.max() + 1, np.int64)
    rank[ids] = np.arange(len(ids))
    counts = rng.multinomial(values, [0.2] * 5)
    pool = rng.integers(0, 1 << SIGN_BITS, distinct, dtype=np.uint64)
    signs = np.concatenate(
        [
            (np.uint64(i) << np.uint64(SIGN_BITS)) | rng.choice(pool, c)
            for i, c in zip(ids, counts, strict=True)
        ]
    )
    got = dedup_slots(signs, counts.astype(np.int64), rank)
    for g, want in zip(got, _reference(signs, counts, rank), strict=True):
        assert g.tolist() == want.tolist()


def test_dedup_slots_of_nothing():
    uniq, local, counts = dedup_slots(np.empty(0, np.uint64), np.zeros(2, np.int64), np.arange(3))
    assert (len(uniq), len(local), counts.tolist()) == (0, 0, [0, 0])


def test_dedup_spans_is_dedup_slots_of_each_span():
    # rows of 0-3 signs per slot (multi-valued slots, empty ones), spans of them (one empty)
    rng = np.random.default_rng(7)
    ids = np.array([1, 2, 5])
    rank = np.zeros(ids.max() + 1, np.int64)
    rank[ids] = np.arange(len(ids))
    lengths = rng.integers(0, 4, (40, len(ids))).astype(np.int64)
    pool = rng.integers(0, 1 << SIGN_BITS, 30, dtype=np.uint64)
    row_signs = [
        np.concatenate([(np.uint64(i) << np.uint64(SIGN_BITS)) | rng.choice(pool, n) for i, n in zip(ids, row, strict=True)])
        for row in lengths
    ]  # fmt: skip
    starts = np.concatenate([[0], np.cumsum(lengths.sum(axis=1))]).astype(np.int64)
    signs = np.concatenate(row_signs).astype(np.uint64)
    bounds = np.array([3, 10, 10, 27, 40], np.int64)
    uniq, local, sign_counts, value_counts = dedup_spans(starts, signs, lengths, bounds, rank)
    u = v = 0
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        slot_major = [s for j in range(len(ids)) for r in range(a, b) for s in row_signs[r][lengths[r, :j].sum() :][: lengths[r, j]]]  # fmt: skip
        counts = lengths[a:b].sum(axis=0)
        want_u, want_local, want_counts = _reference(np.array(slot_major, np.uint64), counts, rank)
        assert value_counts[k].tolist() == counts.tolist() and sign_counts[k].tolist() == want_counts.tolist()
        assert uniq[u : u + len(want_u)].tolist() == want_u.tolist()
        assert local[v : v + counts.sum()].tolist() == want_local.tolist()
        u, v = u + len(want_u), v + counts.sum()
    assert (u, v) == (len(uniq), len(local))


@pytest.mark.parametrize("n", [0, 1, 1500, 20_000])
def test_radix_sort_is_sort(n):
    rng = np.random.default_rng(n)
    wide = rng.integers(0, np.iinfo(np.uint64).max, n, dtype=np.uint64, endpoint=True)
    narrow = wide & np.uint64(0xFF00FF)  # bytes every value shares: skipped
    for x in (wide, narrow):
        assert _radix_sort(x).tolist() == np.sort(x).tolist()


def _columns(raw, **t):
    k = raw.shape[0]
    p = {"default": np.zeros(k), "lo": np.full(k, -np.inf), "hi": np.full(k, np.inf),
         "log1p": np.zeros(k, bool), "mean": np.zeros(k), "std": np.ones(k)} | t  # fmt: skip
    return dense_columns(raw, p["default"], p["lo"], p["hi"], p["log1p"], p["mean"], p["std"])


def test_dense_columns_default_clip_log1p_standardise_transpose():
    raw = np.array([[np.nan, -5.0, 3.0, 1e9], [2.0, np.nan, 0.5, -0.5]])
    out, bad, why = _columns(
        raw, default=np.array([7.0, 1.0]), lo=np.array([0.0, -np.inf]), hi=np.array([100.0, np.inf]),
        log1p=np.array([True, False]), mean=np.array([0.5, 1.0]), std=np.array([2.0, 4.0]),
    )  # fmt: skip
    col0 = (np.log1p(np.clip([7.0, -5.0, 3.0, 1e9], 0, 100)) - 0.5) / 2
    col1 = (np.array([2.0, 1.0, 0.5, -0.5]) - 1) / 4
    assert (bad, why, out.dtype, out.shape) == (-1, 0, np.float32, (4, 2))
    np.testing.assert_allclose(out, np.stack([col0, col1], axis=1).astype(np.float32), rtol=1e-7)


def test_dense_columns_names_the_column_of_a_bad_value():
    assert _columns(np.array([[1.0], [np.inf]]))[1:] == (1, NOT_FINITE)
    assert _columns(np.array([[1.0], [-np.inf]]))[1:] == (1, NOT_FINITE)
    assert _columns(np.array([[-2.0], [1.0]]), log1p=np.array([True, False]))[1:] == (0, LOG1P_DOMAIN)
    # clipped first: a floor above -1 makes the value valid
    assert _columns(np.array([[-2.0]]), log1p=np.array([True]), lo=np.array([0.0]))[1:] == (-1, 0)
