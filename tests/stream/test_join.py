"""The join of one partition without Kafka: positives, negatives at the window's close, duplicate
and late events, early events, dead letters, event-time watermarks and the offsets it lets commit."""

from __future__ import annotations

import pytest

from stream.config import JoinConfig
from stream.join import EVENTS, IMPRESSIONS, JoinCounts, PartitionJoin
from stream.journal import Journal
from stream.records import CORRECTION, LABEL, decode_sample
from stream.spill import Spill
from tests.stream.helpers import N_ITEMS, event, impression


def records(emits) -> list:
    """(emit, record) of every record the emits carry, in order (a window's close emits its
    request's samples as one)."""
    return [(e, value) for e in emits for value in e.values]


def labels(emits, kind: int = LABEL) -> dict[tuple[str, int], float]:
    """(request, item): label of the samples of ``kind`` the emits carry."""
    out = {}
    for e, value in records(emits):
        s = decode_sample(value)
        assert e.key == s.request_id.encode() and not e.dead
        if s.kind == kind:
            out[s.request_id, s.item] = s.label
    return out


def ack_all(join, emits) -> None:
    for e, _ in records(emits):
        join.acked(e.token)


@pytest.fixture
def join():
    j = PartitionJoin(label_after_s=10.0, counts=JoinCounts())
    j.caught_up(EVENTS)  # no events yet: impressions alone set the clock
    return j


def test_positive_at_once_negatives_when_the_window_closes(join):
    assert join.impression(0, impression("r1", 100.0), now=0) == []
    pos = join.event(0, event("r1", 2, 105.0, label=1.0), now=0)
    assert labels(pos) == {("r1", 2): 1.0}
    join.caught_up(EVENTS)  # the consumer reached the end of the events partition again
    assert join.advance(now=0) == []  # the watermark (100) has not passed 110
    join.impression(1, impression("r2", 111.0), now=0)  # event time moves to 111
    neg = join.advance(now=0)
    assert labels(neg) == {("r1", i): 0.0 for i in range(N_ITEMS) if i != 2}
    assert (join.counts.positives, join.counts.negatives, join.open_windows) == (1, N_ITEMS - 1, 1)


def test_duplicate_events_collapse_and_late_events_are_dropped(join):
    join.impression(0, impression("r1", 100.0), now=0)
    assert len(records(join.event(0, event("r1", 1, 101.0), now=0))) == 1
    assert join.event(1, event("r1", 1, 102.0), now=0) == []  # duplicate
    assert join.event(2, event("r1", 3, 111.0), now=0) == []  # after its window
    join.caught_up(EVENTS)
    join.impression(1, impression("r2", 130.0), now=0)
    closed = join.advance(now=0)
    assert len(records(closed)) == N_ITEMS - 1
    assert join.event(3, event("r1", 0, 109.0), now=0) == []  # its window closed meanwhile
    assert join.event(4, event("gone", 0, 50.0), now=0) == []  # a request never seen, long over
    assert (join.counts.duplicates, join.counts.late) == (1, 3)


def test_an_event_before_its_impression_waits_for_it(join):
    assert join.event(0, event("r1", 0, 100.5), now=0) == []
    assert labels(join.impression(0, impression("r1", 100.0), now=0)) == {("r1", 0): 1.0}


def test_an_early_event_whose_impression_never_comes_is_late(join):
    join.impression(0, impression("r0", 100.0), now=0)
    join.event(0, event("nope", 0, 100.0), now=0)
    join.caught_up(EVENTS)
    assert join.offsets.committable() == (0, 0)
    join.impression(1, impression("r2", 120.0), now=0)
    join.advance(now=0)
    assert join.counts.late == 1 and join.offsets.committable()[EVENTS] == 1


def test_malformed_records_become_dead_letters_held_until_acked(join):
    (dead,) = join.impression(0, b"not an impression, but long enough to read a header", now=0)
    assert dead.dead and "impression: not an impression" in dead.reason
    (bad_json,) = join.event(0, b"{", now=0)
    join.impression(1, impression("r1", 100.0), now=0)
    (bad_item,) = join.event(1, event("r1", N_ITEMS, 100.0), now=0)
    assert f"item {N_ITEMS} of a request of {N_ITEMS} items" in bad_item.reason
    assert join.counts.malformed == [1, 2]
    assert join.offsets.committable() == (0, 0)
    ack_all(join, [dead, bad_json, bad_item])
    assert join.offsets.committable() == (1, 2)  # r1's impression stays held: its window is open


def test_offsets_commit_only_after_every_sample_of_a_request_is_acked(join):
    join.impression(0, impression("r1", 100.0), now=0)
    pos = join.event(0, event("r1", 0, 101.0), now=0)
    join.caught_up(EVENTS)
    join.impression(1, impression("r2", 200.0), now=0)
    neg = join.advance(now=0)
    assert join.offsets.committable() == (0, 0)
    *acked, last = records(pos + neg)
    for e, _ in acked:
        join.acked(e.token)
    assert join.offsets.committable() == (0, 0)  # one sample of r1 still unacknowledged
    join.acked(last[0].token)
    assert join.offsets.committable() == (1, 1)  # r2's window is open: its impression is held


def test_the_watermark_waits_for_an_input_that_is_neither_read_nor_caught_up():
    join = PartitionJoin(label_after_s=10.0, counts=JoinCounts())
    join.impression(0, impression("r1", 100.0), now=0)
    join.impression(1, impression("r2", 200.0), now=0)
    assert join.advance(now=0) == []  # the events input may still hold r1's clicks
    join.event(0, event("r2", 0, 199.0), now=0)
    assert len(records(join.advance(now=0))) == N_ITEMS  # events at 199: r1's window (110) is over
    join.caught_up(IMPRESSIONS)
    join.caught_up(EVENTS)
    assert len(records(join.advance(now=15.0))) == N_ITEMS - 1  # both quiet: the wall clock moves time on


def test_an_input_with_records_to_read_holds_the_watermark_at_its_records_time():
    """A lagging input (not caught up) is where its records are, however long the wall clock runs:
    a click read before its impression waits for it instead of passing for late."""
    join = PartitionJoin(label_after_s=10.0, counts=JoinCounts())
    join.impression(0, impression("r1", 100.0), now=0)  # the impressions input has more to read
    join.caught_up(EVENTS)
    assert join.event(0, event("r2", 1, 101.0), now=0) == []  # r2's impression not read yet: early
    join.caught_up(EVENTS)
    assert join.advance(now=1000.0) == [] and join.counts.late == 0  # the wall clock alone moves nothing
    assert labels(join.impression(1, impression("r2", 100.5), now=1000.0)) == {
        ("r2", 1): 1.0
    }  # its early click


def test_a_window_closes_only_once_an_event_past_it_came_or_the_events_were_silent_idle_s():
    """A click pipeline that stops while impressions flow: no window closes as a negative past the
    last event read until the events have been silent ``events_idle_s`` (the input guard judges
    the stop meanwhile); an event past a window's close closes it at once."""
    join = PartitionJoin(label_after_s=10.0, counts=JoinCounts(), events_idle_s=5.0)
    join.impression(0, impression("r1", 100.0), now=100.0)
    join.event(0, event("r1", 1, 101.0), now=101.0)  # the last event for a while
    join.caught_up(EVENTS)
    join.impression(1, impression("r2", 120.0), now=120.0)
    join.caught_up(IMPRESSIONS)
    assert join.advance(now=105.9) == []  # impressions at 120 > r1's close (110), events at 101
    join.event(1, event("r2", 0, 120.5), now=106.0)
    join.caught_up(EVENTS)
    assert len(records(join.advance(now=106.0))) == N_ITEMS - 1  # an event past 110: r1's negatives
    assert join.advance(now=110.9) == []  # r2's close (130): the events silent 4.9 s of 5
    assert len(records(join.advance(now=131.1))) == N_ITEMS - 1  # silent 5 s: the wall clock rules


def test_the_offsets_old_spellings_are_refused_naming_the_new(join):
    with pytest.raises(
        AttributeError, match=r"PartitionJoin.committable is now PartitionJoin.offsets.committable\(\)"
    ):
        join.committable()
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        join.nothing  # noqa: B018


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="label_after_s must be > 0"):
        PartitionJoin(label_after_s=0, counts=JoinCounts())


def test_a_negative_events_idle_s_is_refused_by_name():
    with pytest.raises(ValueError, match=r"--events-idle-s must be >= 0 .*got -1"):
        JoinConfig(events_idle_s=-1.0)


@pytest.mark.parametrize("member", ["1", "2/2", "-1/2", "a/b", "1/"])
def test_a_static_member_must_be_i_of_n(member):
    assert JoinConfig(member="1/3").members() == (1, 3) and JoinConfig().members() is None
    with pytest.raises(ValueError, match="member must be I/N"):
        JoinConfig(member=member)


def test_an_ack_from_before_the_partition_was_assigned_again_is_ignored(join):
    join.acked("a request this join never saw")
    join.acked((IMPRESSIONS, 7))
    assert join.offsets.committable() == (-1, -1) and join.counts.acked == 2


def test_an_early_event_of_a_request_done_does_not_touch_a_later_event_of_the_same_request(join):
    # a click read before its impression, applied when the impression came; the window closes and
    # the request is done; a second click of it, sent after its window (a user's long delay), waits
    # as an early event of the same request id. When the first click's early-expiry comes due, it
    # is not the second's: the second stays held until its own expiry, then is late.
    join.event(0, event("r1", 1, 101.0), now=0)
    join.caught_up(EVENTS)  # impressions alone move the clock from here
    ack_all(join, join.impression(0, impression("r1", 100.0), now=0))  # its positive
    join.impression(1, impression("r2", 110.5), now=0)
    ack_all(join, join.advance(now=0))  # its negatives
    assert "r1" not in join.requests  # closed, every sample acked
    assert join.event(1, event("r1", 2, 111.2), now=0) == []  # after the window, not yet late
    join.caught_up(EVENTS)
    join.impression(3, impression("r4", 111.5), now=0)  # the first click's expiry (111) passed
    join.advance(now=0)
    assert join.requests["r1"].early and join.counts.late == 0
    join.impression(4, impression("r5", 121.5), now=0)
    join.advance(now=0)
    assert "r1" not in join.requests and join.counts.late == 1


def _first_run(join):
    """r1 closes and commits; r2's window stays open, holding event 0: event 1 (r1's, after it)
    was handled but lies past the events' committable offset."""
    join.impression(0, impression("r1", 100.0), now=0)
    join.impression(1, impression("r2", 130.0), now=0)
    ack_all(join, join.event(0, event("r2", 1, 131.0), now=0))
    ack_all(join, join.event(1, event("r1", 2, 105.0), now=0))
    ack_all(join, join.advance(now=0))  # the watermark (130) closes r1 only
    return join.offsets.committable(), (join.offsets.next[IMPRESSIONS], join.offsets.next[EVENTS])


@pytest.mark.parametrize("resumed", [True, False], ids=["resumed", "without-marks"])
def test_a_restart_does_not_count_the_events_it_rereads_as_late(resumed):
    first = PartitionJoin(label_after_s=10.0, counts=JoinCounts())
    (imp_from, ev_from), read_to = _first_run(first)
    assert (imp_from, ev_from) == (1, 0) and read_to == (2, 2) and first.counts.late == 0
    again = PartitionJoin(label_after_s=10.0, counts=JoinCounts())
    if resumed:  # what the joiner committed beside the offsets
        again.offsets.replay_to[IMPRESSIONS] = read_to[0]
        again.offsets.replay_to[EVENTS] = read_to[1]
    again.impression(1, impression("r2", 130.0), now=0)
    again.event(0, event("r2", 1, 131.0), now=0)
    again.event(1, event("r1", 2, 105.0), now=0)  # r1 closed before the restart
    again.event(2, event("r1", 3, 106.0), now=0)  # never read before: late indeed
    assert (again.counts.late, again.counts.replayed) == ((1, 1) if resumed else (2, 0))


def test_a_restarts_reread_click_of_a_settled_request_is_no_input_while_it_waits():
    """The input guard's count of events (read, less replayed, less waiting unplaced) takes a
    re-read click of a request settled before the restart at no moment: it waits unplaced until
    its window is over, then it is replayed."""
    again = PartitionJoin(label_after_s=10.0, counts=JoinCounts())
    again.offsets.replay_to[EVENTS] = 1

    def told() -> int:
        return again.counts.events - again.counts.replayed - again.waiting

    again.event(0, event("r1", 2, 105.0), now=0)  # r1 settled before: its impression is not read again
    assert (again.waiting, told()) == (1, 0)
    again.impression(0, impression("r2", 200.0), now=0)
    again.caught_up(EVENTS)
    ack_all(again, again.advance(now=0))
    assert (again.waiting, again.counts.replayed, again.counts.late, told()) == (0, 1, 0, 0)
    again.event(1, event("r3", 0, 201.0), now=0)  # a new click waits for its impression, then counts
    assert (again.waiting, told()) == (1, 0)
    again.impression(1, impression("r3", 200.5), now=0)
    assert (again.waiting, told()) == (0, 1)


def test_a_held_join_keeps_windows_open_labels_late_clicks_and_quarantines_at_its_bound(join):
    join.impression(0, impression("r1", 100.0), now=0)
    join.hold_s = 30.0  # the input guard tripped
    assert join.event(0, event("r1", 1, 104.0), now=0) == []  # a positive waits for its window's close
    join.caught_up(EVENTS)
    join.impression(1, impression("r2", 120.0), now=0)  # event time 120: r1's window (110) is past
    assert join.advance(now=0) == [] and join.held_windows(now=0) == 1
    assert join.event(1, event("r1", 2, 108.0), now=0) == []  # a click delayed by the outage, in its window
    join.caught_up(EVENTS)
    join.hold_s = None  # the guard cleared: r1 closes as usual, both clicks labelled
    out = join.advance(now=0)
    assert labels(out) == {("r1", i): float(i in (1, 2)) for i in range(N_ITEMS)}
    assert not any(e.quarantine for e in out) and join.counts.quarantined == 0
    join.hold_s = 30.0  # tripped again; r2's window (130) is held to 160, then quarantined
    join.impression(2, impression("r3", 159.0), now=0)
    assert join.advance(now=0) == []
    join.impression(3, impression("r4", 161.0), now=0)
    out = join.advance(now=0)
    assert len(records(out)) == N_ITEMS and all(e.quarantine for e in out)
    assert join.counts.quarantined == N_ITEMS


def test_a_clear_releases_the_held_windows_as_usual_or_to_quarantine(join):
    join.hold_s = 30.0
    join.impression(0, impression("r1", 100.0), now=0)
    join.impression(1, impression("r2", 101.0), now=0)
    join.event(0, event("r1", 1, 104.0), now=0)
    join.caught_up(EVENTS)
    join.impression(2, impression("r3", 115.0), now=0)  # r1 and r2 past their close, held
    assert join.advance(now=0) == [] and join.held_labels(now=0) == (2 * N_ITEMS, 1)
    out = join.release(now=0, quarantine=True)  # too few clicks came back: quarantined
    assert len(records(out)) == 2 * N_ITEMS and all(e.quarantine for e in out) and join.hold_s is None
    assert join.held_labels(now=0) == (0, 0) and join.open_windows == 1  # r3's window is still open
    join.impression(3, impression("r4", 130.0), now=0)  # r3, impressed while held, closes: quarantined too
    out = join.advance(now=0)
    assert len(records(out)) == N_ITEMS and all(e.quarantine for e in out)


def test_for_one_window_after_a_quarantine_clicks_wait_for_the_rest_of_their_request(join):
    join.hold_s = 30.0
    join.impression(0, impression("r1", 100.0), now=0)
    join.caught_up(EVENTS)
    join.impression(1, impression("r2", 111.0), now=0)
    join.release(now=0, quarantine=True)  # r1 closes to quarantine; the window after runs to 121
    join.impression(2, impression("r3", 112.0), now=0)
    assert join.event(0, event("r3", 1, 113.0), now=0) == []  # waits for r3's close
    join.caught_up(EVENTS)
    join.impression(3, impression("r4", 125.0), now=0)  # after the window: clicks at once again
    assert len(records(join.event(1, event("r4", 2, 126.0), now=0))) == 1
    join.caught_up(EVENTS)
    join.impression(4, impression("r5", 140.0), now=0)
    closed = labels(join.advance(now=0))
    assert closed[("r3", 1)] == 1.0 and sum(closed.values()) == 1.0  # r3's click came with r3's window


def test_a_release_whose_clicks_came_emits_what_a_live_join_would_have_in_its_order(join):
    join.impression(0, impression("r0", 100.0), now=0)
    first = join.event(0, event("r0", 0, 101.0), now=0)
    assert len(records(first)) == 1  # before the trip: at once
    join.hold_s = 30.0
    join.impression(1, impression("r1", 105.0), now=0)
    join.impression(2, impression("r2", 112.0), now=0)
    for offset, (rid, item, ts) in enumerate([("r0", 1, 103.0), ("r1", 2, 106.0), ("r2", 3, 114.0)], 1):
        assert join.event(offset, event(rid, item, ts), now=0) == []  # delivered late, held
    join.caught_up(EVENTS)
    join.impression(3, impression("r3", 116.0), now=0)  # r0 and r1 past their close; r2 open
    out = join.release(now=0, quarantine=False)
    got = [
        (s.request_id, s.item, s.label, s.ts + s.elapsed) for s in (decode_sample(v) for _, v in records(out))
    ]
    negatives = lambda rid, at, clicked: [(rid, i, 0.0, at) for i in range(N_ITEMS) if i not in clicked]  # noqa: E731
    assert got == [("r0", 1, 1.0, 103.0), ("r1", 2, 1.0, 106.0), *negatives("r0", 110.0, (0, 1)),
                   ("r2", 3, 1.0, 114.0), *negatives("r1", 115.0, (2,))]  # fmt: skip
    assert all(e.key == e.token.encode() == rid.encode() for e, (rid, *_) in zip(out, got[:2], strict=False))
    assert (join.counts.positives, join.counts.negatives, join.hold_s) == (4, 2 * N_ITEMS - 3, None)
    assert len(records(join.event(4, event("r2", 0, 117.0), now=0))) == 1  # r2's clicks at once now
    ack_all(join, first + out)
    assert join.offsets.committable()[IMPRESSIONS] == 2  # r0 and r1 done: r2's impression is the oldest held


def test_held_labels_of_the_impressions_read_while_held(join):
    join.impression(0, impression("r1", 100.0), now=0)  # before the trip: its click came
    join.event(0, event("r1", 1, 101.0), now=0)
    join.hold_s = 30.0
    join.impression(1, impression("r2", 102.0), now=0)  # while held: no click came
    join.caught_up(EVENTS)
    join.impression(2, impression("r3", 120.0), now=0)
    assert join.held_labels(now=0) == (2 * N_ITEMS, 1)
    assert join.held_labels(now=0, suspect=True) == (N_ITEMS, 0)


@pytest.fixture
def correcting(tmp_path):
    """Label after 10 s, attribute clicks for 100 s; closed requests' impressions spilled to disk."""
    j = PartitionJoin(label_after_s=10.0, counts=JoinCounts(), attribution_s=100.0,
                      spill=Spill(tmp_path / "spill", bucket_s=10.0))  # fmt: skip
    j.caught_up(EVENTS)
    return j


def test_a_click_after_the_first_horizon_corrects_the_items_negative(correcting):
    join = correcting
    join.impression(0, impression("r1", 100.0), now=0)
    pos = join.event(0, event("r1", 2, 105.0), now=0)
    assert labels(pos) == {("r1", 2): 1.0}  # within 10 s: at once
    ack_all(join, pos)
    assert join.event(1, event("r1", 3, 130.0), now=0) == []  # after 10 s, before the close: waits for it
    join.impression(1, impression("r2", 111.0), now=0)  # event time 111 closes r1
    closed = join.advance(now=0)
    assert labels(closed) == {("r1", i): 0.0 for i in range(N_ITEMS) if i != 2}  # 3 a negative first
    assert labels(closed, CORRECTION) == {("r1", 3): 1.0}  # then its correction, after it
    assert join.requests["r1"].writer is None  # the rows went: a correction reads the impression spilled
    ack_all(join, closed)
    fixed = join.event(2, event("r1", 1, 150.0), now=0)
    (s,) = [decode_sample(v) for _, v in records(fixed)]
    assert (s.kind, s.elapsed, s.key, s.label) == (CORRECTION, 50.0, ("r1", 1, CORRECTION), 1.0)
    assert join.event(3, event("r1", 1, 151.0), now=0) == [] and join.counts.duplicates == 1
    assert join.event(4, event("r1", 0, 201.0), now=0) == [] and join.counts.late == 1  # past 100 s
    assert (join.counts.positives, join.counts.corrections) == (1, 2)
    # held until its attribution window is over and every sample acked: a restart rebuilds it
    ack_all(join, fixed)
    assert join.offsets.committable()[IMPRESSIONS] == 0 and join.spill.bytes > 0
    join.impression(2, impression("r3", 230.5), now=0)
    join.event(5, event("r3", 0, 230.5), now=0)  # the events pass 211 too
    join.caught_up(EVENTS)
    ack_all(join, join.advance(now=0))  # r2 closes; r1's (200) and r2's (211) attribution windows end
    assert "r1" not in join.requests and join.offsets.committable() == (2, 5)
    assert join.spill.bytes == len(impression("r3", 230.5))  # the segments of r1 and r2 are deleted


def test_a_correction_whose_impression_is_gone_is_counted_lost(correcting):
    join = correcting
    join.impression(0, impression("r1", 100.0), now=0)
    join.impression(1, impression("r2", 111.0), now=0)
    ack_all(join, join.advance(now=0))
    join.spill.clear()  # the disk lost it
    assert join.event(0, event("r1", 1, 140.0), now=0) == [] and join.counts.corrections_lost == 1


def test_an_attribution_window_ends_when_the_events_show_it_over_not_the_impressions_alone(correcting):
    """The events input read to its end while the impressions run ahead (a producer writes a
    stretch of impressions before its clicks): a click still in flight within the window counts."""
    join = correcting
    join.impression(0, impression("r1", 100.0), now=0)
    join.event(0, event("r1", 1, 150.0), now=0)  # the events' clock at 150
    join.caught_up(EVENTS)
    join.impression(1, impression("r2", 230.0), now=0)  # r1's window (200) over by the impressions
    ack_all(join, join.advance(now=0))
    assert "r1" in join.requests  # the events have not passed 200
    fixed = join.event(1, event("r1", 2, 199.0), now=0)  # in flight when the impressions ran ahead
    assert labels(fixed, CORRECTION) == {("r1", 2): 1.0} and join.counts.late == 0
    ack_all(join, fixed)
    join.event(2, event("r2", 0, 231.0), now=0)  # the events past 200
    join.caught_up(EVENTS)
    ack_all(join, join.advance(now=0))
    assert "r1" not in join.requests
    assert join.event(3, event("r1", 3, 200.5), now=0) == [] and join.counts.late == 1


def test_attribution_must_cover_the_first_horizon_and_have_a_spill():
    with pytest.raises(ValueError, match="attribution_s must be 0 .* or >= label_after_s"):
        PartitionJoin(label_after_s=10.0, counts=JoinCounts(), attribution_s=5.0)
    with pytest.raises(ValueError, match="needs a spill"):
        PartitionJoin(label_after_s=10.0, counts=JoinCounts(), attribution_s=50.0)
    with pytest.raises(ValueError, match="--attribution-s must be 0"):
        JoinConfig(label_after_s=10.0, attribution_s=5.0)


def test_a_settled_request_commits_past_itself_and_a_restart_restores_it_from_the_journal(tmp_path):
    def join_on(keep: bool) -> PartitionJoin:
        j = PartitionJoin(label_after_s=10.0, counts=JoinCounts(), attribution_s=100.0,
                          spill=Spill(tmp_path / "spill", bucket_s=10.0, keep=keep), journal=Journal(tmp_path / "journal"))  # fmt: skip
        j.caught_up(EVENTS)
        return j

    first = join_on(keep=False)
    first.impression(0, impression("r1", 100.0), now=0)
    first.impression(1, impression("r2", 111.0), now=0)
    ack_all(first, first.advance(now=0))  # r1's first labels acknowledged: settled, its offset released
    assert first.offsets.committable() == (1, -1) and first.requests["r1"].held == []
    fixed = first.event(0, event("r1", 1, 150.0), now=0)
    assert first.offsets.committable() == (1, 0)  # the correction's event is held until acknowledged
    ack_all(first, fixed)
    assert first.offsets.committable() == (1, 1)
    # the joiner dies; the next run restores what the journal says and reads from the offsets
    again = join_on(keep=True)
    again.restore(Journal(tmp_path / "journal").replay())
    assert again.impression(0, impression("r1", 100.0), now=0) == []  # re-read (an older request held it)
    assert again.counts.replayed_items == N_ITEMS  # not input again (the joiner's input guard)
    assert again.event(0, event("r1", 1, 150.0), now=0) == [] and again.counts.duplicates == 1
    (late,) = [decode_sample(v) for _, v in records(again.event(1, event("r1", 3, 160.0), now=0))]
    assert (late.key, late.elapsed) == (("r1", 3, CORRECTION), 60.0)  # from the spill the first run wrote
    (dead,) = again.impression(2, impression("r1", 120.0), now=0)  # another impression of the id: refused
    assert dead.dead and "seen twice" in dead.reason


def test_an_event_before_its_impression_is_refused_beyond_the_clocks_skew(join):
    join.impression(0, impression("r1", 100.0), now=0)
    assert labels(join.event(0, event("r1", 1, 99.5), now=0)) == {("r1", 1): 1.0}  # within SKEW_S: a click
    (dead,) = join.event(1, event("r1", 2, 97.0), now=0)
    assert dead.dead and dead.reason == "event: ts 97.000 is 3.000 s before its impression's"
    assert join.counts.malformed == [0, 1]


def test_a_click_for_an_unknown_request_is_a_dead_letter_and_one_for_a_request_done_with_is_late(join):
    """A request done with is remembered for an hour (``KNOWN_FOR_S``; twice the attribution window
    where that is longer): a click up to then is late, whatever the first horizon (10 s here)."""
    join.impression(0, impression("a", 100.0), now=0)  # the join knows every impression from 100 on
    join.impression(1, impression("r0", 3650.0), now=0)
    join.caught_up(EVENTS)
    join.impression(2, impression("r1", 3690.0), now=0)
    ack_all(join, join.advance(now=0))  # r0 closes (its negatives acknowledged): done with
    assert "r0" not in join.requests and "r0" in join.done
    join.event(0, event("r0", 1, 3701.0), now=0)  # 51 s after its impression: waits for one of its time
    join.event(1, event("ghost", 1, 3701.0), now=0)
    join.caught_up(EVENTS)
    join.impression(3, impression("r2", 3711.0), now=0)
    (dead,) = [e for e in join.advance(now=0) if e.dead]  # an hour back from 3701: every impression known
    assert dead.reason == "event: no impression of request 'ghost' in the 3600 s before it"
    assert (join.counts.late, join.counts.malformed[EVENTS]) == (1, 1)  # r0's click: late
    assert join.offsets.committable()[EVENTS] == 1  # the dead letter holds its offset until acknowledged
    join.acked(dead.token)
    assert join.offsets.committable()[EVENTS] == 2
    assert join.event(2, event("ghost", 1, 3615.0), now=0) == []  # under an hour after the first impression
    assert (join.counts.late, join.counts.malformed[EVENTS]) == (2, 1)  # the join cannot tell: late


def test_an_early_event_whose_impression_never_comes_is_a_dead_letter_once_the_join_knows_that_far(join):
    join.impression(0, impression("r0", 100.0), now=0)
    assert join.event(0, event("nope", 0, 3730.0), now=0) == []  # waits for its impression
    join.caught_up(EVENTS)
    join.impression(1, impression("r2", 3741.0), now=0)
    dead = [e for e in join.advance(now=0) if e.dead]
    assert [e.reason for e in dead] == ["event: no impression of request 'nope' in the 3600 s before it"]
    assert join.counts.late == 0 and "nope" not in join.requests
