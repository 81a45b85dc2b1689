"""The mock Kafka cluster behaves as the stream tests need: several processes produce and consume
through it in one consumer group, offsets they commit are kept, and the group rebalances when a
member is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from loadtest import mockbroker
from tests.helpers import wait_until


def produce(bootstrap: str, topic: str, keys) -> None:
    p = Producer({"bootstrap.servers": bootstrap})
    for k in keys:
        p.produce(topic, key=str(k).encode(), value=b"v")
    assert p.flush(30) == 0


def lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def assignment(path) -> set[int] | None:
    """The partitions a member's last ASSIGNED line names (None before its first)."""
    last = [ln.split()[1:] for ln in lines(path) if ln.startswith("ASSIGNED")]
    if not last:
        return None
    return {int(p) for p in last[-1][0].split(",")} if last[-1] else set()


def events(logs) -> dict[str, list[str]]:
    """Each member log's lines other than GOT, to show when a wait fails."""
    return {path.name: [ln for ln in lines(path) if not ln.startswith("GOT")][-20:] for path in logs}


def got(path) -> set[tuple[int, int]]:
    return {(int(a), int(b)) for _, a, b in (ln.split() for ln in lines(path) if ln.startswith("GOT"))}


def member(kafka, topic: str, group: str, log):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "tests.stream.member", kafka.bootstrap, topic, group],
                                stdout=out, stderr=subprocess.STDOUT, env=env)  # fmt: skip


def test_topic_spec_parses_and_refuses():
    assert mockbroker.TopicSpec.parse("a:3") == mockbroker.TopicSpec("a", 3)
    assert mockbroker.TopicSpec.parse("a").partitions == mockbroker.DEFAULT_PARTITIONS
    with pytest.raises(ValueError, match="NAME or NAME:PARTITIONS"):
        mockbroker.TopicSpec.parse("a:0")


def test_control_refuses_a_bad_topic(kafka):
    with pytest.raises(RuntimeError, match="NAME or NAME:PARTITIONS"):
        kafka.create_topic("bad", 0)


@pytest.mark.slow
def test_group_members_split_commit_and_rebalance_after_sigkill(kafka, tmp_path):
    topic = kafka.create_topic("broker-group", 4)
    produce(kafka.bootstrap, topic, range(200))
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    procs = [member(kafka, topic, "g", log) for log in logs]
    try:

        def wait(predicate, what: str, members=procs) -> None:
            """Wait for ``predicate``; a member of ``members`` that exits fails it at once, and a
            failed wait shows the members' exit codes and their logs' events."""
            exited = lambda: [p.returncode for p in members if p.poll() is not None]  # noqa: E731
            try:
                wait_until(lambda: exited() or predicate(), 60, what)
                assert not exited(), f"a member exited while waiting for {what}"
            except AssertionError as e:
                raise AssertionError(f"{e}; exit codes {[p.poll() for p in procs]}; {events(logs)}") from None

        def split() -> bool:  # the first member's assignment is revoked when the second joins
            a, b = (assignment(x) for x in logs)
            return bool(a and b and not a & b and a | b == {0, 1, 2, 3})

        wait(split, "both members assigned, the four partitions split between them")
        wait(lambda: len(got(logs[0]) | got(logs[1])) == 200, "200 records consumed")
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        wait(lambda: assignment(logs[0]) == {0, 1, 2, 3}, "the survivor owns every partition", procs[:1])
        produce(kafka.bootstrap, topic, range(200, 300))
        wait(lambda: len(got(logs[0]) | got(logs[1])) == 300, "the 100 later records consumed", procs[:1])
        # committed offsets are kept by the broker: they equal the end of every partition
        c = Consumer({"bootstrap.servers": kafka.bootstrap, "group.id": "g"})
        committed = c.committed([TopicPartition(topic, p) for p in range(4)], timeout=10)
        ends = [c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(4)]
        c.close()
        assert [tp.offset for tp in committed] == ends and sum(ends) == 300
    finally:
        for p in procs:
            p.kill()
            p.wait()
