"""A delta's record: written and read back typed, its keys verified, another format refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from model_store import CorruptVersion, RecordError, UnknownFormat
from model_store.deltas import NAME, DeltaManifest, read_delta, read_keys, write_delta


def test_a_record_and_its_keys_round_trip(tmp_path):
    keys, ts = np.array([b"\0\0\0\1r-1", b"\0\0\0\2r-1"]), np.array([1.0, 2.0])
    written = write_delta(tmp_path, DeltaManifest("kafka://b/t", {"t/0": 5}, samples=2, auc=0.7), (keys, ts))
    record = read_delta(tmp_path)
    assert record == written and record.positions == {"t/0": 5} and record.keys_count == 2
    got, got_ts = read_keys(tmp_path, record)
    assert got.tolist() == keys.tolist() and got_ts.tolist() == ts.tolist()
    (tmp_path / record.keys).write_bytes(b"changed")
    with pytest.raises(CorruptVersion, match="checksum"):
        read_keys(tmp_path, record)


def test_no_record_is_none_and_a_bad_one_is_refused(tmp_path):
    assert read_delta(tmp_path) is None
    (tmp_path / NAME).write_text(json.dumps({"format": "recserve-delta/9", "source": "x"}))
    with pytest.raises(UnknownFormat):
        read_delta(tmp_path)
    (tmp_path / NAME).write_text(json.dumps({"format": "recserve-delta/1", "source": "x", "positions": [1]}))
    with pytest.raises(RecordError, match="positions"):
        read_delta(tmp_path)
