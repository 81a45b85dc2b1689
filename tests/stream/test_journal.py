"""The journal of settled requests: lines folded back into requests, a torn last line ignored, and
a compaction that keeps only what is still settled."""

from __future__ import annotations

import numpy as np

from stream.join_state import _Request
from stream.journal import Journal, Settled


def test_lines_fold_back_into_the_requests_they_settled(tmp_path):
    j = Journal(tmp_path / "j")
    j.settled("r1", Settled(4, 100.0, 5, (10, 0, 77), {2}, quarantine=False))
    j.settled("r2", Settled(5, 101.0, 3, (10, 77, 60), set(), quarantine=True))
    j.clicked("r1", [0, 4])
    j.clicked("gone", [1])  # a request the file no longer holds (compacted away): nothing to fold into
    j.close()
    (tmp_path / "j").open("ab").write(b'{"r": "r3", "o": 6, "t"')  # killed mid-write
    got = Journal(tmp_path / "j").replay()
    assert got == {
        "r1": Settled(4, 100.0, 5, (10, 0, 77), {0, 2, 4}),
        "r2": Settled(5, 101.0, 3, (10, 77, 60), set(), True),
    }
    req = got["r1"].request(label_after_s=10.0)
    assert (req.closed, req.settled, req.deadline, req.labelled.tolist()) == (
        True,
        True,
        110.0,
        [1, 0, 1, 0, 1],
    )


def test_a_compaction_keeps_the_settled_requests_only(tmp_path):
    j = Journal(tmp_path / "j")
    j.settled("old", Settled(1, 50.0, 2, (5, 0, 10)))
    labelled = np.array([False, True])
    live = {"r1": _Request(ts=100.0, offset=3, where=(10, 0, 9), labelled=labelled, closed=True, settled=True),
            "open": _Request(ts=120.0, offset=4, labelled=np.zeros(2, bool))}  # fmt: skip
    j.compact(live)
    assert j.replay() == {"r1": Settled(3, 100.0, 2, (10, 0, 9), {1})}
    j.clicked("r1", [0])  # appends after a compaction still land
    assert Journal(tmp_path / "j").replay()["r1"].clicked == {0, 1}
    j.clear()
    assert j.replay() == {} and j.bytes == 0


def test_a_compaction_leaves_out_corrections_not_yet_acknowledged(tmp_path):
    # item 1's correction is in flight: journalled clicked, a restart would drop its re-read event
    # as a duplicate, and the correction, never delivered, would be lost
    j = Journal(tmp_path / "j")
    req = _Request(ts=100.0, offset=3, where=(10, 0, 9), labelled=np.array([True, True]), closed=True,
                   settled=True, unjournaled=[1])  # fmt: skip
    j.compact({"r1": req})
    assert j.replay()["r1"].clicked == {0}
