"""The join's spill: values kept on disk by the time their window ends, read back where ``put``
said, deleted a segment at a time once the watermark passed it."""

from __future__ import annotations

import pytest

from stream.spill import Spill


def test_values_read_back_until_their_segment_expires(tmp_path):
    spill = Spill(tmp_path / "s", bucket_s=10.0)
    a, b, c = spill.put(105.0, b"alpha"), spill.put(109.0, b"beta"), spill.put(115.0, b"gamma")
    assert (spill.get(a), spill.get(b), spill.get(c)) == (b"alpha", b"beta", b"gamma")
    assert sorted(f.name for f in (tmp_path / "s").iterdir()) == ["10.seg", "11.seg"] and spill.bytes == 14
    spill.expire(119.0)  # bucket 10 ends at 110: gone; bucket 11 ends at 120: kept
    assert (spill.get(a), spill.get(c)) == (None, b"gamma") and spill.bytes == 5
    assert [f.name for f in (tmp_path / "s").iterdir()] == ["11.seg"]
    spill.clear()
    assert spill.get(c) is None and list((tmp_path / "s").iterdir()) == []


def test_a_spill_starts_empty_whatever_its_directory_held(tmp_path):
    Spill(tmp_path / "s", bucket_s=1.0).put(5.0, b"from a run before")
    assert [f.name for f in (tmp_path / "s").iterdir()] == ["5.seg"]
    again = Spill(tmp_path / "s", bucket_s=1.0)
    assert again.bytes == 0 and list((tmp_path / "s").iterdir()) == []
    with pytest.raises(ValueError, match="bucket_s must be > 0"):
        Spill(tmp_path / "t", bucket_s=0)
