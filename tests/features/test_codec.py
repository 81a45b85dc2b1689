import random
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from features import stream
from features.batch import CompactBatch, SlotView
from features.codec import HEADER_SIZE, CodecError, decode, encode
from features.readers import to_records
from features.schema import load_schema
from features.transform import transform
from features.xxh64 import xxh64 as _xxh64


@st.composite
def batches(draw):
    rows = draw(st.integers(0, 12))
    has_context = draw(st.booleans())
    n_slots = draw(st.integers(0, 6))
    slots = []
    for _ in range(n_slots):
        context = has_context and draw(st.booleans())
        srows = 1 if context else rows
        multi = draw(st.booleans())
        if multi:
            lengths = draw(st.lists(st.integers(0, 4), min_size=srows, max_size=srows))
            n_values = sum(lengths)
            offsets = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64))).astype(np.uint32)
        else:
            n_values, offsets = srows, None
        n_signs = draw(st.integers(1, max(1, n_values))) if n_values else 0
        pool = draw(st.lists(st.integers(0, 2**64 - 1), min_size=n_signs, max_size=n_signs, unique=True))
        signs = np.array(sorted(pool), dtype=np.uint64)
        values = np.array(
            draw(st.lists(st.integers(0, max(0, n_signs - 1)), min_size=n_values, max_size=n_values))
        )
        slots.append(SlotView(signs, values.astype(np.int64), offsets, context))
    n_dense = draw(st.integers(0, 3))
    floats = st.floats(-1e6, 1e6, width=32)
    dense = np.array(draw(st.lists(floats, min_size=rows * n_dense, max_size=rows * n_dense)), np.float32)
    n_ctx = draw(st.integers(0, 3)) if has_context else 0
    ctx = np.array(draw(st.lists(floats, min_size=n_ctx, max_size=n_ctx)), np.float32)
    labels = (
        np.array(draw(st.lists(floats, min_size=rows, max_size=rows)), np.float32)
        if draw(st.booleans())
        else None
    )
    return CompactBatch.from_slots(
        rows, slots, dense.reshape(rows, n_dense), ctx, labels, has_context, draw(st.integers(0, 2**64 - 1))
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_round_trip(batch):
    blob = encode(batch)
    assert len(blob) % 8 == 0
    out = decode(blob)
    assert out == batch
    assert encode(out) == blob


def test_large_counts_use_wider_indices():
    n = 70_000
    signs = np.arange(n, dtype=np.uint64) * np.uint64(3)
    values = np.random.default_rng(0).integers(0, n, size=n)
    b = CompactBatch.from_slots(n, [SlotView(signs, values, None, False)], np.zeros((n, 0), np.float32))
    assert b.values.dtype == np.uint32
    assert decode(encode(b)) == b


def test_context_only_and_views_are_zero_copy():
    s = [SlotView(np.array([5], np.uint64), np.array([0]), None, True)]
    b = CompactBatch.from_slots(
        3, s, np.zeros((3, 0), np.float32), np.array([1.5], np.float32), has_context=True
    )
    blob = encode(b)
    out = decode(blob)
    assert out == b and out.slot(0).context
    assert not out.signs.flags.writeable  # a view of the immutable bytes, not a copy


# --- fuzzing valid blobs ------------------------------------------------------------------------
def _blobs():
    criteo = load_schema("data/schemas/criteo.yaml")
    obd = load_schema("data/schemas/obd.yaml")
    t = stream.read("data/criteo/wide_resdnn_criteo_test.tsv", criteo, limit=40)
    items = to_records(stream.read("data/obd/item_context.csv", obd), obd)[:20]
    multi = CompactBatch.from_slots(
        4,
        [
            SlotView(
                np.array([1, 9, 40], np.uint64),
                np.array([0, 2, 1, 1, 0]),
                np.array([0, 2, 2, 4, 5], np.uint32),
                False,
            ),
            SlotView(np.array([7], np.uint64), np.array([0]), None, True),
        ],
        np.ones((4, 2), np.float32),
        np.array([0.5], np.float32),
        None,
        True,
        77,
    )
    return [
        encode(transform(t, criteo)),
        encode(transform({"context": {"user_feature_0": "u"}, "items": items}, obd)),
        encode(multi),
    ]


def _fix_checksum(blob: bytearray) -> bytes:
    struct.pack_into(
        "<Q", blob, 8, int(_xxh64(np.frombuffer(bytes(blob), np.uint8)[16:], len(blob) - 16, np.uint64(0)))
    )
    return bytes(blob)


def _decodes_to_valid_batch_or_raises(blob: bytes) -> None:
    try:
        b = decode(blob)
    except CodecError:
        return
    assert encode(b) == blob  # what decodes is a fully consistent batch


def test_fuzz_truncations_flips_and_inflated_counts():
    rng = random.Random(1234)
    cases = still_valid = 0
    for blob in _blobs():
        for _ in range(400):  # truncation
            with pytest.raises(CodecError):
                decode(blob[: rng.randrange(0, len(blob))])
            cases += 1
        for _ in range(400):  # raw bit flips: caught (checksum or structure)
            ba = bytearray(blob)
            for _ in range(rng.randint(1, 3)):
                ba[rng.randrange(len(ba))] ^= 1 << rng.randrange(8)
            if bytes(ba) != blob:
                with pytest.raises(CodecError):
                    decode(bytes(ba))
                cases += 1
        for _ in range(400):  # bit flips with a recomputed checksum: structure checks alone
            ba = bytearray(blob)
            pos = rng.randrange(16, len(ba))
            ba[pos] ^= 1 << rng.randrange(8)
            _decodes_to_valid_batch_or_raises(_fix_checksum(ba))
            cases += 1
        nslots = struct.unpack_from("<I", blob, 28)[0]
        count_fields = [24, 28, 32, 36] + [HEADER_SIZE + 4 * i for i in range(2 * nslots)]
        for _ in range(200):  # inflated counts
            ba = bytearray(blob)
            off = rng.choice(count_fields)
            old = struct.unpack_from("<I", ba, off)[0]
            struct.pack_into(
                "<I", ba, off, rng.choice([old + 1, old + rng.randint(2, 1000), 2**31, 2**32 - 1])
            )
            with pytest.raises(CodecError):
                decode(bytes(ba))
            # with the checksum recomputed, the counts alone must fail -- except where the inflated
            # count describes another valid batch (e.g. one more float that fits in zero padding)
            try:
                decode(_fix_checksum(ba))
                still_valid += 1
            except CodecError:
                pass
            cases += 2
    assert cases > 4000
    assert still_valid < 10


@pytest.mark.parametrize("junk", [b"", b"RSCB", bytes(47), bytes(4096), "a string", 12, None, [1, 2]])
def test_garbage_inputs_raise_codec_error(junk):
    with pytest.raises(CodecError):
        decode(junk)


def test_unknown_version_and_schema_mismatch_are_named():
    blob = bytearray(_blobs()[2])
    with pytest.raises(CodecError, match="schema"):
        decode(bytes(blob), schema_hash=78)
    struct.pack_into("<H", blob, 4, 2)
    with pytest.raises(CodecError, match="unknown version 2"):
        decode(bytes(blob))


def test_encode_refuses_inconsistent_batch():
    b = CompactBatch.from_slots(2, [SlotView(np.array([3, 1], np.uint64), np.array([0, 1]), None, False)],
                                np.zeros((2, 0), np.float32))  # fmt: skip
    with pytest.raises(CodecError, match="strictly increasing"):
        encode(b)
