"""The guards' history (``<model>/GUARDS.log``): events appended by the one writer and read back in
order by the one reader; an unreadable line is skipped by name, never fatal; an unknown guard or
event is refused."""

from __future__ import annotations

import pytest

from model_store.guards import GuardEvent, read_guards, record


def test_events_round_trip_in_order_and_a_bad_line_is_skipped_by_name(tmp_path):
    record(tmp_path, GuardEvent("output", "trip", "served AUC fell", version="3", delta=7))
    record(tmp_path, GuardEvent("output", "rewind", version="3", delta=8, to=6))
    with open(tmp_path / "GUARDS.log", "a") as f:
        f.write("{not json\n")
    record(tmp_path, GuardEvent("input", "clear", "label rate back"))
    events, bad = read_guards(tmp_path)
    assert [(e.guard, e.event) for e in events] == [
        ("output", "trip"),
        ("output", "rewind"),
        ("input", "clear"),
    ]
    assert events[1].to == 6 and events[0].at <= events[2].at
    assert len(bad) == 1 and "GUARDS.log:3" in bad[0]
    assert [e.event for e in read_guards(tmp_path, last=1)[0]] == ["clear"]
    assert read_guards(tmp_path / "none") == ([], [])


def test_an_unknown_event_is_refused():
    with pytest.raises(ValueError, match="one of"):
        record("/nonexistent", GuardEvent("output", "explode"))


def test_a_history_that_cannot_be_written_is_logged_not_raised(tmp_path, caplog):
    from model_store.guards import record_or_log

    record_or_log(tmp_path / "missing", GuardEvent("input", "trip", "label rate fell"))
    assert "cannot record the input guard's trip" in caplog.text
