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


def _keys(*names: bytes):
    return np.array(names)


def test_added_key_files_read_back_as_the_window_as_of_their_record(tmp_path):
    """A whole-window file, then files of the keys added since the record before: read as the
    window of the last record, each key once with its latest time, out-of-window keys dropped."""
    d0, d1, d2 = (tmp_path / "deltas" / str(i) for i in range(3))
    for d in (d0, d1, d2):
        d.mkdir(parents=True)
    write_delta(d0, DeltaManifest("s", keys_since=-5.0), (_keys(b"a", b"b"), np.array([1.0, 2.0])))
    write_delta(d1, DeltaManifest("s", keys_after="../0", keys_since=0.0, keys_links=1, keys_added=1),
                (_keys(b"c"), np.array([5.0])))  # fmt: skip
    # b again, trained after it left the window (its time then: 20)
    last = write_delta(d2, DeltaManifest("s", keys_after="../1", keys_since=1.5, keys_links=2, keys_added=3),
                       (_keys(b"b", b"d"), np.array([20.0, 6.0])))  # fmt: skip
    assert last.keys_count == 2  # only its own keys
    keys, ts = read_keys(d2, read_delta(d2))
    assert keys.tolist() == [b"b", b"c", b"d"] and ts.tolist() == [20.0, 5.0, 6.0]  # a: out of the window
    keys, _ = read_keys(d1, read_delta(d1))
    assert keys.tolist() == [b"a", b"b", b"c"]
    (d0 / NAME).unlink()
    with pytest.raises(CorruptVersion, match="gone"):
        read_keys(d2, read_delta(d2))


def test_a_format_1_record_is_still_read(tmp_path):
    keys, ts = _keys(b"a", b"b"), np.array([1.0, 2.0])
    written = write_delta(tmp_path, DeltaManifest("s", {"t/0": 2}), (keys, ts))
    old = {k: v for k, v in json.loads((tmp_path / NAME).read_text()).items()
           if k not in ("keys_after", "keys_since", "keys_links", "keys_added")}  # fmt: skip
    (tmp_path / NAME).write_text(json.dumps(old | {"format": "recserve-delta/1"}))
    record = read_delta(tmp_path)
    assert record is not None and record.format == "recserve-delta/1" and record.keys == written.keys
    assert read_keys(tmp_path, record)[0].tolist() == [b"a", b"b"]
