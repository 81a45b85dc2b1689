"""Update notices (serving/notices/): the record's one reader, the transport registry, a process's
``Notices`` (malformed records counted, never raised; another model's ignored) and the wake-ups."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving import notices
from serving.notices import Notice, NoticeError, Notices, Wake, decode, encode


@given(st.text(min_size=1), st.integers(0, 10**6).map(str), st.integers(-1, 2**40),
       st.floats(0, 2e9, allow_nan=False))  # fmt: skip
def test_a_notice_round_trips(model, version, seq, ts):
    n = Notice(model, version, seq, ts)
    assert decode(encode(n)) == n


@pytest.mark.parametrize(("data", "why"), [
    (b"", "not JSON"),
    (b"[1]", "expected an object"),
    (b'{"model": "m", "version": "1", "delta_seq": 1}', "expected an object with keys"),
    (b'{"model": "m", "version": "1", "delta_seq": 1, "ts": 1, "x": 0}', "expected an object with keys"),
    (b'{"model": "", "version": "1", "delta_seq": 1, "ts": 1}', "bad model"),
    (b'{"model": "m", "version": "v1", "delta_seq": 1, "ts": 1}', "bad model"),
    (b'{"model": "m", "version": "1", "delta_seq": -2, "ts": 1}', "delta_seq"),
    (b'{"model": "m", "version": "1", "delta_seq": true, "ts": 1}', "delta_seq"),
    (b'{"model": "m", "version": "1", "delta_seq": 1, "ts": "now"}', "ts must be"),
])  # fmt: skip
def test_a_record_that_is_no_notice_is_refused_by_name(data, why):
    with pytest.raises(NoticeError, match=why):
        decode(data)


def test_transports_are_a_registry_that_refuses_an_unknown_name():
    assert {"kafka", "inotify", "none"} <= set(notices.TRANSPORTS)
    assert notices.parse("kafka://h:1/t")[1] == "h:1/t"
    with pytest.raises(ValueError, match="unknown notice transport 'zmq://x'; known: .*kafka"):
        notices.parse("zmq://x")
    with pytest.raises(ValueError, match="expected kafka://BROKERS/TOPIC"):
        notices.parse("kafka://h:1")  # refused at start, not when the listener first connects
    with pytest.raises(ValueError, match="inotify takes no address"):
        notices.parse("inotify://x")
    assert notices.announcer("") is None and notices.announcer("inotify") is None  # the file is the notice
    assert notices.open_notices("none", "/nowhere/m") is None


def test_a_malformed_record_is_counted_and_another_models_ignored(tmp_path):
    n = Notices("none", tmp_path / "m")  # records handed in by hand: what a transport does
    got = []
    n.subscribe(got.append)
    n.received(b"\xff garbage")
    n.received(encode(Notice("other", "1", 1, 0.0)))
    n.received(encode(Notice("m", "1", 2, 0.0)))
    assert got == [Notice("m", "1", 2, 0.0)] and n.last is not None and n.last[0] == got[0]
    lag = n.registry.get_sample_value(
        "recserve_notice_lag_seconds", {"transport": "none", "version": "1", "seq": "2"}
    )
    assert lag == n.last[1] > 0
    assert (n.count("malformed"), n.count("other_model"), n.count("ok")) == (1, 1, 1)
    assert (
        n.registry.get_sample_value("recserve_notices_total", {"transport": "none", "outcome": "malformed"})
        == 1
    )


def test_a_subscriber_that_fails_does_not_starve_the_others(tmp_path):
    n = Notices("none", tmp_path / "m")
    got = []

    def bad(_):
        raise RuntimeError("bug")

    n.subscribe(bad)
    n.subscribe(got.append)
    n.deliver(Notice("m", "1", 1, 0.0))
    assert len(got) == 1


def test_a_wake_is_set_by_the_notices_it_wants_only(tmp_path):
    n = Notices("none", tmp_path / "m")
    wake = Wake(n, lambda notice: notice.delta_seq > 3)
    n.deliver(Notice("m", "1", 2, 0.0))
    assert not wake.event.is_set()
    n.deliver(Notice("m", "1", 4, 0.0))
    assert wake.wait(0)
    assert not wake.event.is_set()  # cleared by the wait
    wake.close()
    n.deliver(Notice("m", "1", 5, 0.0))
    assert not wake.event.is_set()


def test_a_wake_without_notices_times_out_like_a_poll():
    wake = Wake(None)
    assert wake.wait(0.01) is False
    wake.set()
    assert wake.wait(5) is True
