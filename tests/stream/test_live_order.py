import numpy as np
import pytest

from features.codec import decode
from stream.join_state import Emit
from stream.live_order import in_live_order, live_times
from stream.records import Event, SampleWriter, decode_impression, decode_sample
from stream.rows import RowTable
from tests.stream.helpers import impression


def writer(rid: str, ts: float) -> SampleWriter:
    imp = decode_impression(impression(rid, ts))
    return SampleWriter(imp, RowTable.of(decode(imp.batch)))


def test_samples_go_in_the_order_a_live_join_emits_them_each_run_an_emit_of_its_request():
    a, b = writer("a", 100.0), writer("b", 104.0)
    closing_a = Emit(
        b"a", a.closing([Event("a", 0, 1.0, 101.0)], np.array([1, 2]), 10.0), token="a"
    )  # 101, 110, 110
    clicks_b = Emit(b"b", [b.labelled(Event("b", 3, 1.0, 105.0)), b.labelled(Event("b", 1, 1.0, 112.0))],
                    token="b", quarantine=True)  # fmt: skip
    dead = Emit(b"", [b"x"], dead=True, token=(1, 7))
    out = in_live_order([closing_a, dead, clicks_b])
    assert out[0] is dead
    got = [(e.key, e.token, e.quarantine, [(s.item, s.ts + s.elapsed) for s in map(decode_sample, e.values)])
           for e in out[1:]]  # fmt: skip
    assert got == [(b"a", "a", False, [(0, 101.0)]), (b"b", "b", True, [(3, 105.0)]),
                   (b"a", "a", False, [(1, 110.0), (2, 110.0)]), (b"b", "b", True, [(1, 112.0)])]  # fmt: skip
    assert in_live_order([dead]) == [dead] and in_live_order([]) == []


def test_a_record_shorter_than_a_sample_header_is_refused_by_name():
    with pytest.raises(ValueError, match="shorter than its header"):
        live_times([b"RSSM"])
