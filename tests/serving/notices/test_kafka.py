"""``kafka://`` notices (serving/notices/kafka.py) against the test broker: every listening process
sees every notice (each its own consumer, from the topic's end); a malformed record is counted and
the listener goes on."""

from __future__ import annotations

import queue

from confluent_kafka import Producer

from serving.notices import Notice, Notices, announcer


def test_every_listener_gets_every_notice_and_a_malformed_one_is_counted(kafka, tmp_path):
    spec = f"kafka://{kafka.bootstrap}/{kafka.create_topic('notices-m', 1)}"
    listeners, queues = [], []
    for _ in range(2):  # two serving processes' worth
        q: queue.Queue = queue.Queue()
        n = Notices(spec, tmp_path / "m")
        n.subscribe(q.put)
        listeners.append(n)
        queues.append(q)
    try:
        for n in listeners:
            assert n.listener.assigned.wait(30), "listener never assigned"
        garbage = Producer({"bootstrap.servers": kafka.bootstrap})
        garbage.produce("notices-m", b"not a notice")
        assert garbage.flush(10) == 0
        a = announcer(spec)
        assert a is not None
        notice = Notice("m", "3", 7, 1767225600.25)
        a.announce(notice)
        a.close()
        assert a.failed == 0
        for n, q in zip(listeners, queues, strict=True):
            assert q.get(timeout=20) == notice  # after the malformed record: the listener went on
            assert n.count("malformed") == 1 and n.count("ok") == 1
    finally:
        for n in listeners:
            n.close()


def test_an_undelivered_notice_is_counted_not_raised(monkeypatch):
    import serving.notices.kafka

    monkeypatch.setattr(serving.notices.kafka, "TIMEOUT_S", 0.5)
    a = announcer("kafka://127.0.0.1:1/notices-m")  # nothing listens there
    assert a is not None
    a.announce(Notice("m", "1", 1, 0.0))  # returns at once: the writer never waits on the broker
    a.close()
    assert a.failed == 1
