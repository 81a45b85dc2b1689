"""Samples read together (``sample_batch.read_samples``) are what ``decode_sample`` reads one at
a time; a malformed one is refused with ``decode_sample``'s reason, the others kept."""

from __future__ import annotations

from dataclasses import fields

import numpy as np

from stream.records import CORRECTION, LABEL, Event, SampleWriter, decode_sample
from stream.records import SAMPLE_HEAD as HEAD
from stream.rows import RowTable
from stream.sample_batch import KIND_BIT, Samples, read_samples, request_ids, span, take, to_batch, to_batches
from tests.serving.helpers import SCHEMA, ranking_batch
from tests.stream.helpers import impression_record


def _blobs() -> list[bytes]:
    writer = SampleWriter(impression_record("r-7"), RowTable.of(ranking_batch()))
    return [writer.encode(item, float(item % 2)) for item in range(writer.num_rows)]


def test_read_together_is_read_one_at_a_time():
    blobs = _blobs()
    s, bad = read_samples(blobs)
    assert bad == [] and s.num_rows == len(blobs)
    for i, blob in enumerate(blobs):
        one = decode_sample(blob)
        row = one.row
        assert s.keys[i] == one.item.to_bytes(4, "big") + one.request_id.encode()
        assert (s.ts[i], s.labels[i], int(s.schema_hash[i])) == (one.ts, one.label, row.schema_hash)
        assert (s.scores[i], s.arms[i]) == (np.float32(one.score), one.arm.encode())
        np.testing.assert_array_equal(s.flags[i], row.flags)
        np.testing.assert_array_equal(s.lengths[i], row.lengths)
        np.testing.assert_array_equal(s.signs[s.starts[i] : s.starts[i + 1]], row.signs)
        np.testing.assert_array_equal(s.dense[i], np.concatenate([row.dense, row.context_dense]))
        assert s.f_ctx[i] == len(row.context_dense)


def test_a_malformed_record_is_refused_with_its_reason_and_the_rest_kept():
    blobs = _blobs()
    mangled = [blobs[0][:-4], b"XXXX" + blobs[1][4:], b"", blobs[2]]
    s, bad = read_samples(mangled)
    assert [i for i, _ in bad] == [0, 1, 2] and s.index.tolist() == [3]
    assert "header says" in bad[0][1] and "not a sample" in bad[1][1] and "too short" in bad[2][1]
    picked = take(read_samples(blobs)[0], np.array([2]))
    np.testing.assert_array_equal(picked.signs, s.signs)
    assert picked.keys.tolist() == s.keys.tolist()


def test_a_record_whose_lengths_or_dense_values_do_not_hold_is_refused_and_the_rest_read():
    # headers that hold: the compiled gather (stream.sample_kernels) finds these
    blobs = _blobs()
    nan_dense = blobs[1][:-4] + np.float32(np.nan).tobytes()
    head = np.frombuffer(blobs[2][: HEAD.itemsize], HEAD)[0]
    strings = int(head["l_rid"]) + int(head["l_emb"]) + int(head["l_dense"]) + int(head["l_arm"])
    at = HEAD.itemsize + strings + int(head["slots"])  # the first slot's length word
    first = int.from_bytes(blobs[2][at : at + 4], "little")
    bad_length = blobs[2][:at] + (first + 1).to_bytes(4, "little") + blobs[2][at + 4 :]
    s, bad = read_samples([blobs[0], nan_dense, bad_length, *blobs[3:]])
    assert [i for i, _ in bad] == [1, 2] and s.index.tolist() == [0, *range(3, len(blobs))]
    whole, _ = read_samples(blobs)
    kept = take(whole, s.index)
    for f in fields(Samples):
        np.testing.assert_array_equal(getattr(s, f.name), getattr(kept, f.name), err_msg=f.name)


def test_a_record_of_another_shape_first_does_not_refuse_the_rest():
    from features.schema import load_schema
    from tests.training.sources.samples import ROOT, records

    blobs = _blobs()
    one = decode_sample(blobs[0]).row
    shape = (len(one.flags), len(one.dense) + len(one.context_dense))
    criteo = records(load_schema(ROOT / "data/schemas/criteo.yaml"), 1)[0][3]  # 26 slots, 13 dense values
    s, bad = read_samples([criteo, *blobs], shape)
    assert s.index.tolist() == list(range(1, len(blobs) + 1))
    assert [i for i, _ in bad] == [0] and f"(26, 13), expected {shape}" in bad[0][1]


def test_each_sample_keeps_its_served_score_and_arm():
    import dataclasses

    rows = RowTable.of(ranking_batch())
    blobs = [SampleWriter(dataclasses.replace(impression_record(f"r-{arm}"), arm=arm), rows).encode(1, 1.0)
             for arm in ("", "control", "b")]  # fmt: skip
    s, bad = read_samples(blobs)
    assert bad == [] and s.arms.tolist() == [b"", b"control", b"b"]
    assert s.scores.tolist() == [float(impression_record().scores[1])] * 3
    assert take(s, np.array([2, 0])).arms.tolist() == [b"b", b""]


def test_request_ids_of_keys():
    from stream.sample_batch import request_ids

    s, _ = read_samples(_blobs())
    assert set(request_ids(s.keys).tolist()) == {b"r-7"}


def test_a_span_is_the_take_of_its_rows_without_a_copy():
    s, _ = read_samples(_blobs())
    lo, hi = 2, s.num_rows - 1
    spanned, taken = span(s, lo, hi), take(s, np.arange(lo, hi))
    for f in fields(Samples):
        np.testing.assert_array_equal(getattr(spanned, f.name), getattr(taken, f.name), err_msg=f.name)
    assert np.shares_memory(spanned.signs, s.signs) and span(s, 3, 3).num_rows == 0


def test_the_batches_of_spans_are_the_batches_of_the_spans_alone():
    # a context's dense values and a multi-valued slot (offsets) included; one span empty
    s, _ = read_samples(_blobs() * 3)
    bounds = np.array([0, 2, 2, 5, s.num_rows])
    got = to_batches(s, bounds, SCHEMA)
    assert [b.num_rows for b in got] == np.diff(bounds).tolist()
    for batch, lo, hi in zip(got, bounds[:-1], bounds[1:], strict=True):
        assert batch == to_batch(take(s, np.arange(lo, hi)), SCHEMA)
    assert len(got[1].signs) == 0 and len(got[2].offsets) > 0


def test_a_correction_reads_with_its_kind_and_delay_and_keys_apart_from_the_label():
    writer = SampleWriter(impression_record("r-7"), RowTable.of(ranking_batch()))  # ts 100
    blobs = [writer.encode(1, 0.0, LABEL, 10.0), writer.labelled(Event("r-7", 1, 1.0, 130.0), CORRECTION)]
    s, bad = read_samples(blobs)
    assert bad == [] and s.kinds.tolist() == [LABEL, CORRECTION] and s.elapsed.tolist() == [10.0, 30.0]
    assert s.keys[0] == (1).to_bytes(4, "big") + b"r-7"  # a label's key is the (request, item) pair's
    assert s.keys[1] == (1 | KIND_BIT).to_bytes(4, "big") + b"r-7" != s.keys[0]
    assert request_ids(s.keys).tolist() == [b"r-7", b"r-7"]
    broken = blobs[1][:66] + b"\x05" + blobs[1][67:]  # no such kind
    _, bad = read_samples([blobs[0], broken])
    assert bad == [(1, "sample kind must be 0 (a label) or 1 (a correction), got 5")]
