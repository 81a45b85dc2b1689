"""The requests a join is done with: remembered by hash until their horizon passes, and what an
event no open request takes names."""

from __future__ import annotations

from stream.recent import DoneRequests


def test_a_request_done_with_is_remembered_for_its_horizon_then_forgotten():
    done = DoneRequests(horizon_s=100.0)
    done.seen(0.0)
    done.add("r1", ts=10.0)
    assert "r1" in done and "r2" not in done and len(done) == 1
    done.expire(105.0)  # r1's horizon (110) not passed
    assert "r1" in done
    done.expire(110.0 + done.bucket_s)  # passed, to the bucket
    assert "r1" not in done and len(done) == 0


def test_an_event_names_an_unknown_request_only_where_the_join_saw_every_impression_before_it():
    done = DoneRequests(horizon_s=100.0)
    assert done.unknown("x", 1e9) == ""  # nothing read yet
    done.seen(50.0)
    done.add("r1", ts=60.0)
    assert done.unknown("x", 149.0) == ""  # its 100 s before reach back before 50: late, maybe
    assert done.unknown("x", 150.0) == "no impression of request 'x' in the 100 s before it"
    assert done.unknown("r1", 150.0) == ""  # done with: a late click
