"""Events, impressions and samples: each reader inverts its writer (hypothesis round trips), and a
malformed record is refused with a RecordError naming the problem."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stream.records import (
    CORRECTION,
    LABEL,
    Event,
    Impression,
    RecordError,
    SampleWriter,
    Versions,
    decode_event,
    decode_impression,
    decode_sample,
    encode_event,
    encode_impression,
)
from stream.rows import RowTable
from tests.serving.helpers import ITEMS, ranking_batch
from tests.stream.helpers import impression_record

texts = st.text(min_size=1, max_size=40)
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)


@given(texts, st.integers(0, 2**31), finite, st.floats(0, 2e9))
def test_event_round_trip(rid, item, label, ts):
    e = Event(rid, item, label, ts)
    assert decode_event(encode_event(e)) == e


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"{", "not JSON"),
        (b"[1]", "JSON object"),
        (b'{"request_id": "r", "item": 1, "label": 1}', r"missing \['ts'\]"),
        (b'{"request_id": "r", "item": 1, "label": 1, "ts": 0, "x": 1}', r"unknown \['x'\]"),
        (b'{"request_id": "", "item": 1, "label": 1, "ts": 0}', "request_id"),
        (b'{"request_id": "r", "item": -1, "label": 1, "ts": 0}', "item must be an integer >= 0"),
        (b'{"request_id": "r", "item": 1.5, "label": 1, "ts": 0}', "item must be an integer"),
        (b'{"request_id": "r", "item": 1, "label": "1", "ts": 0}', "label must be a finite number"),
        (b'{"request_id": "r", "item": 1, "label": 1e300, "ts": 0}', "label must be within"),
    ],
)
def test_malformed_events_are_refused(raw, why):
    with pytest.raises(RecordError, match=why):
        decode_event(raw)


@settings(max_examples=30)
@given(texts, st.floats(0, 2e9), st.integers(-1, 2**40), texts, texts)
def test_impression_round_trip(rid, ts, seq, emb, dense):
    imp = Impression(
        rid, ts, Versions(emb, seq, dense), np.array([0.5, 0.25], np.float32), b"\x01\x02batch", emb
    )
    assert decode_impression(encode_impression(imp)) == imp


def test_an_impression_of_version_1_is_still_read_with_no_arm():
    blob = bytearray(encode_impression(impression_record()))
    blob[4:6] = (1).to_bytes(2, "little")  # version 1: the arm's length was reserved (zero)
    assert decode_impression(bytes(blob)) == impression_record()
    blob[38:40] = (3).to_bytes(2, "little")
    with pytest.raises(RecordError, match="version 1 has a non-zero reserved field"):
        decode_impression(bytes(blob))


def test_impression_carries_the_batch_bytes_exactly():
    imp = impression_record()
    assert decode_impression(encode_impression(imp)).batch == imp.batch


@pytest.mark.parametrize(
    ("mangle", "why"),
    [
        (lambda b: b[:10], "too short"),
        (lambda b: b"XXXX" + b[4:], "not an impression"),
        (lambda b: b[:4] + b"\x03" + b[5:], "version 3 is not supported"),
        (lambda b: b + b"\0", "header says"),
        (lambda b: b[:-1], "header says"),
    ],
)
def test_malformed_impressions_are_refused(mangle, why):
    with pytest.raises(RecordError, match=why):
        decode_impression(mangle(encode_impression(impression_record())))


def test_samples_carry_the_items_row_and_round_trip():
    imp = impression_record()
    rows = RowTable.of(ranking_batch())
    writer = SampleWriter(imp, rows)
    for item in range(rows.num_rows):
        s = decode_sample(writer.encode(item, float(item % 2)))
        assert s.key == ("r-1", item, LABEL) and s.label == item % 2 and s.ts == 100.0
        assert s.versions == Versions("v1", 3, "v1")
        assert s.row == rows.row(item)
        assert s.score == float(imp.scores[item]) and s.arm == ""


def test_a_sample_carries_the_served_score_and_the_arm():
    imp = dataclasses.replace(impression_record(), arm="candidate-a")
    s = decode_sample(SampleWriter(imp, RowTable.of(ranking_batch())).encode(1, 1.0))
    assert (s.score, s.arm, s.label) == (float(imp.scores[1]), "candidate-a", 1.0) and s.score > 0


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.integers(0, len(ITEMS) - 1), min_size=1, max_size=10),
    st.data(),
    st.text(max_size=12),
    texts,
)
def test_samples_encoded_together_are_those_encoded_one_at_a_time(picks, data, arm, rid):
    # rows of every kind (context slots, multi-valued bags empty or not), any items in any order,
    # repeated, labels and scores of any float32, an arm and a request id of any text
    batch = ranking_batch(items=[ITEMS[i] for i in picks])
    n = batch.num_rows
    scores = np.array(data.draw(st.lists(finite, min_size=n, max_size=n)), np.float32)
    imp = dataclasses.replace(impression_record(rid), scores=scores, arm=arm)
    writer = SampleWriter(imp, RowTable.of(batch))
    items = data.draw(st.lists(st.integers(0, n - 1), max_size=2 * n))
    labels = data.draw(st.lists(finite, min_size=len(items), max_size=len(items)))
    elapsed = np.array(data.draw(st.lists(finite, min_size=len(items), max_size=len(items))), np.float32)
    many = writer.encode_many(np.array(items, np.int64), np.array(labels, np.float32), elapsed)
    assert many == [
        writer.encode(i, label, LABEL, float(e)) for i, label, e in zip(items, labels, elapsed, strict=True)
    ]


def test_a_closing_window_emits_its_clicks_then_its_negatives():
    imp = impression_record()
    writer = SampleWriter(imp, RowTable.of(ranking_batch()))
    clicks = [Event("r-1", 3, 1.0, 101.0), Event("r-1", 0, 0.5, 102.0)]
    closing = writer.closing(clicks, np.array([1, 2]), horizon=10.0)
    assert closing == [writer.labelled(clicks[0]), writer.labelled(clicks[1]), writer.encode(1, 0.0, LABEL, 10.0),
                       writer.encode(2, 0.0, LABEL, 10.0)]  # fmt: skip
    read = [decode_sample(v) for v in closing]
    assert [(s.label, s.kind, s.elapsed) for s in read] == [(1.0, LABEL, 1.0), (0.5, LABEL, 2.0), (0.0, LABEL, 10.0),
                                                          (0.0, LABEL, 10.0)]  # fmt: skip
    assert writer.closing([], np.array([], np.int64), 10.0) == []


def test_a_correction_is_the_items_sample_again_of_its_own_kind_with_its_delay():
    imp = impression_record()  # ts 100
    writer = SampleWriter(imp, RowTable.of(ranking_batch()))
    late = decode_sample(writer.labelled(Event("r-1", 2, 1.0, 160.5), CORRECTION))
    first = decode_sample(writer.encode(2, 0.0, LABEL, 5.0))
    assert (late.kind, late.elapsed, late.label, late.row) == (CORRECTION, 60.5, 1.0, first.row)
    assert late.key == ("r-1", 2, CORRECTION) != first.key


def test_malformed_samples_are_refused():
    blob = SampleWriter(impression_record(), RowTable.of(ranking_batch())).encode(0, 1.0)
    with pytest.raises(RecordError, match="not a sample"):
        decode_sample(encode_impression(impression_record()))
    with pytest.raises(RecordError, match="header says"):
        decode_sample(blob[:-4])
    with pytest.raises(RecordError, match="a sample version 1 is not supported"):
        decode_sample(blob[:4] + b"\x01" + blob[5:])  # written before samples carried the score
    with pytest.raises(RecordError, match="a sample version 2 is not supported .*knows 3"):
        decode_sample(blob[:4] + b"\x02" + blob[5:])  # written before samples carried their kind
    with pytest.raises(RecordError, match="sample kind must be 0 .* or 1 .*, got 7"):
        decode_sample(blob[:66] + b"\x07" + blob[67:])
