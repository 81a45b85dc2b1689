"""RowTable lays out every row of a batch: each slot's signs of row r are the batch's, read the
slow way (slot view, per row) for context, multi-valued and single-valued slots alike."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.rows import RowTable
from tests.serving.helpers import ITEMS, ranking_batch


def naive_row(batch, r: int, s: int) -> np.ndarray:
    view = batch.slot(s)
    rr = 0 if view.context else r
    if view.offsets is None:
        return view.signs[view.values[rr : rr + 1]]
    return view.signs[view.values[view.offsets[rr] : view.offsets[rr + 1]]]


def test_every_row_and_slot_matches_the_batch():
    batch = ranking_batch()
    table = RowTable.of(batch)
    assert table.num_rows == batch.num_rows == 4
    for r in range(batch.num_rows):
        row = table.row(r)
        for s in range(batch.num_slots):
            np.testing.assert_array_equal(row.slot_signs(s), naive_row(batch, r, s))
        np.testing.assert_array_equal(row.dense, batch.dense[r])
        np.testing.assert_array_equal(row.context_dense, batch.context_dense)
    assert int(table.lengths.sum()) == len(table.signs)
    assert table.row(1).lengths[4] == 0  # an empty multi-valued bag ("tags": "") stays empty


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, len(ITEMS) - 1), min_size=1, max_size=12))
def test_any_mix_of_items_is_laid_out_as_the_batch_holds_it(picks):
    batch = ranking_batch(items=[ITEMS[i] for i in picks])  # repeated items, empty bags, one row
    table = RowTable.of(batch)
    for r in range(batch.num_rows):
        row = table.row(r)
        for s in range(batch.num_slots):
            np.testing.assert_array_equal(row.slot_signs(s), naive_row(batch, r, s))
    assert table.lengths.dtype == np.uint32 and table.signs.dtype == np.uint64
    assert table.starts[-1] == len(table.signs) == int(table.lengths.sum())
