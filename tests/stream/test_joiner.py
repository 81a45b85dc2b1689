"""``recserve join`` against the mock Kafka cluster: labels, duplicates, late events and dead
letters end to end with their counters; a joiner SIGKILLed mid-run and restarted loses no sample,
as a group member and as a static member (``--member``); two joiners split the partitions either way
(as a group member, the second joins a running group)."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from serving.rpc.procs import spawn, stop_children
from stream import dead_letter
from stream.config import JoinConfig
from stream.joiner import Joiner, JoinError
from tests.helpers import free_port, wait_until
from tests.stream.helpers import (
    N_ITEMS,
    PARTS,
    TopicReader,
    event,
    impression,
    join_args,
    produce,
    samples_by_key,
    short_session,
    topics,
)


def test_labels_duplicates_late_events_and_dead_letters(kafka):
    # a partition whose events end before its windows close closes them after --events-idle-s
    cfg = replace(topics(kafka, "e2e"), events_idle_s=2.0)
    now = time.time()
    produce(kafka.bootstrap, cfg.impressions, [("a", impression("a", now)), ("b", impression("b", now)),
                                               ("x", b"garbage, and long enough for a header" * 2)])  # fmt: skip
    produce(kafka.bootstrap, cfg.events, [("a", event("a", 1, now + 0.1)), ("a", event("a", 1, now + 0.2)),
                                          ("b", event("b", 3, now + 5.0)), ("b", b"{not json")])  # fmt: skip
    registry, at_end = CollectorRegistry(), []
    joiner = Joiner(cfg, registry, read_to_end=lambda: at_end.append(time.time()))
    assert joiner.check_topics() == PARTS
    stop = threading.Event()
    thread = threading.Thread(target=joiner.run, args=(stop,), daemon=True)
    thread.start()
    samples = TopicReader(kafka.bootstrap, cfg.samples, PARTS)
    dead = [TopicReader(kafka.bootstrap, t, PARTS) for t in cfg.dead_letters()]  # impressions', events'
    try:
        wait_until(
            lambda: samples.poll() >= 2 * N_ITEMS and all(d.poll() >= 1 for d in dead), 60,
            "8 samples and a dead letter of each input",
        )  # fmt: skip
        labels = samples_by_key(samples)
        assert labels == {(r, i): [1.0 if (r, i) == ("a", 1) else 0.0] for r in "ab" for i in range(N_ITEMS)}
        for reader, topic, value in zip(
            dead, (cfg.impressions, cfg.events), (b"garbage", b"{not json"), strict=True
        ):
            ((_, got, h),) = reader.records  # unchanged, where it was read and why (stream.dead_letter)
            headers = dead_letter.read_headers(list(h.items()))
            assert got.startswith(value) and set(headers) == set(dead_letter.HEADERS)
            assert (
                headers["topic"] == topic
                and int(headers["offset"]) >= 0
                and 0 <= int(headers["partition"]) < PARTS
            )
            assert headers["reason"].startswith("impression:" if topic == cfg.impressions else "event:")

        def metric(name, **labels):
            return registry.get_sample_value(f"recserve_join_{name}", labels)

        wait_until(lambda: metric("late_events_total") == 1, 30, "the late event counted")
        assert len(at_end) == 1  # told once that every input was read to its end (recserve join trims)
        assert metric("duplicate_events_total") == 1
        assert (
            metric("samples_total", label="positive") == 1 and metric("samples_total", label="negative") == 7
        )
        assert (
            metric("dead_letters_total", input="impressions")
            == metric("dead_letters_total", input="events")
            == 1
        )
    finally:
        stop.set()
        thread.join(30)
        samples.close()
        for reader in dead:
            reader.close()
    assert not thread.is_alive()


def test_missing_or_unequal_topics_are_refused(kafka):
    cfg = topics(kafka, "refuse")
    with pytest.raises(JoinError, match="do not exist"):
        Joiner(JoinConfig(brokers=kafka.bootstrap, impressions="nope", events=cfg.events, samples=cfg.samples,
                          dead_letter=cfg.dead_letter)).check_topics()  # fmt: skip
    with pytest.raises(JoinError, match="member 4/5 has no partition"):
        Joiner(JoinConfig(brokers=kafka.bootstrap, impressions=cfg.impressions, events=cfg.events,
                          samples=cfg.samples, dead_letter=cfg.dead_letter, member="4/5")).check_topics()  # fmt: skip
    with pytest.raises(JoinError, match=r"\['nope'\] do not exist"):  # one topic for every dead letter
        Joiner(replace(cfg, dead_letter="nope")).check_topics()
    bare = kafka.create_topic("refuse-bare-impressions", PARTS)  # no dead-letter topic by the rule
    with pytest.raises(
        JoinError, match=r"\['refuse-bare-impressions.dead'\] do not exist.*--dead-letter TOPIC"
    ):
        Joiner(replace(cfg, impressions=bare)).check_topics()
    other = kafka.create_topic("refuse-events-2", PARTS + 1)
    kafka.create_topic(dead_letter.topic_of(other), 1)
    with pytest.raises(JoinError, match="same number of partitions"):
        Joiner(JoinConfig(brokers=kafka.bootstrap, impressions=cfg.impressions, events=other, samples=cfg.samples,
                          dead_letter=cfg.dead_letter)).check_topics()  # fmt: skip


def test_a_restarted_joiner_does_not_count_the_events_it_rereads_as_late(kafka, tmp_path):
    """A restart re-reads the events past the oldest held one; those it handled before (their
    windows closed and committed) are counted replayed, not late again: the joiner commits how far
    it read beside each offset (it counted 46 and 48 late events after restarts before)."""
    names = {k: kafka.create_topic(f"replay-{k}", 1) for k in ("impressions", "events", "samples")}
    for k in ("impressions", "events"):
        kafka.create_topic(dead_letter.topic_of(names[k]), 1)
    # the second joiner joins the group the first left: held for the rebalance delay (short_session)
    cfg = JoinConfig(brokers=kafka.bootstrap, impressions=names["impressions"], events=names["events"],
                     samples=names["samples"], group="replay-join", label_after_s=30.0, commit_every_s=0.2,
                     kafka_config=short_session(tmp_path))  # fmt: skip
    now = time.time()
    produce(
        kafka.bootstrap,
        cfg.impressions,
        [("old", impression("old", now - 100)), ("open", impression("open", now))],
    )
    # event 0 is held by the open window; event 1 is the old request's, joined and committed before the restart
    produce(
        kafka.bootstrap,
        cfg.events,
        [("open", event("open", 1, now + 0.1)), ("old", event("old", 2, now - 99.9))],
    )
    samples = TopicReader(kafka.bootstrap, cfg.samples, 1)

    def run(joiner: Joiner, until, what: str) -> None:
        stop = threading.Event()
        thread = threading.Thread(target=joiner.run, args=(stop,), daemon=True)
        thread.start()
        try:
            wait_until(until, 60, what)
        finally:
            stop.set()  # flush and commit
            thread.join(30)
        assert not thread.is_alive()

    first = Joiner(cfg, CollectorRegistry())
    run(first, lambda: samples.poll() >= N_ITEMS + 1 and first.counts.acked >= N_ITEMS + 1,
        "the old request's samples and the open one's positive")  # fmt: skip
    second = Joiner(cfg, CollectorRegistry())
    # the input guard is told of what entered: the open request again, with its click, not the old
    # click, at no look (the old click waits unplaced until it is late, so replayed)
    told: list[int] = []

    def settled() -> bool:
        told.append(second.guard.events)
        return second.counts.replayed == 1 and (second.guard.items, second.guard.events) == (N_ITEMS, 1)

    run(second, settled, "both events read again, the guard told of the open request and its click only")
    samples.close()
    assert max(told) == 1, told
    assert (first.counts.late, second.counts.late, second.counts.events) == (0, 0, 2)


def workload(kafka, cfg: JoinConfig, requests: range) -> dict[tuple[str, int], float]:
    """Impressions of ``requests`` (now) and a click on item r % N_ITEMS of each; the labels due."""
    now = time.time()
    ids = [f"r{r}" for r in requests]
    produce(kafka.bootstrap, cfg.impressions, [(i, impression(i, now)) for i in ids])
    produce(
        kafka.bootstrap,
        cfg.events,
        [(i, event(i, r % N_ITEMS, now + 0.1)) for r, i in zip(requests, ids, strict=True)],
    )
    return {
        (i, k): float(k == r % N_ITEMS) for r, i in zip(requests, ids, strict=True) for k in range(N_ITEMS)
    }


@pytest.mark.slow
@pytest.mark.parametrize("member", ["", "0/1"], ids=["group", "static"])
def test_a_joiner_sigkilled_and_restarted_loses_no_sample(kafka, tmp_path, member):
    cfg = topics(kafka, f"kill-{member.replace('/', '-') or 'group'}")
    cfg.label_after_s, cfg.member = 3.0, member
    cfg.kafka_config = short_session(tmp_path)  # the group notices the dead member after it
    due = workload(kafka, cfg, range(0, 200))
    reader = TopicReader(kafka.bootstrap, cfg.samples, PARTS)
    proc = spawn(join_args(cfg), tmp_path / "join-1.log")
    try:
        wait_until(lambda: reader.poll() > 0, 60, "the first joiner's first samples")
        # its imports out of the collector's scans before it joins (serving/memory.py)
        assert "objects loaded for good" in (tmp_path / "join-1.log").read_text()
        due |= workload(kafka, cfg, range(200, 400))  # its windows are open when it dies
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        proc = spawn(join_args(cfg), tmp_path / "join-2.log")
        wait_until(
            lambda: "assigned partitions" in (tmp_path / "join-2.log").read_text(),
            60,
            "the successor's partitions",
        )
        back_s = time.monotonic() - killed
        wait_until(lambda: reader.poll() and set(samples_by_key(reader)) >= set(due), 120,
                   "every (request, item) joined after the restart")  # fmt: skip
    finally:
        stop_children([proc])
        reader.close()
    got = samples_by_key(reader)
    assert set(got) == set(due)  # 0 lost, nothing made up
    assert {k: set(v) for k, v in got.items()} == {
        k: {v} for k, v in due.items()
    }  # re-sent, never relabelled
    resent = len(reader.records) - len(got)
    print(f"{len(got)} samples, {resent} produced again after the restart (at least once; the trainer drops "
          f"them by key); the successor held its partitions {back_s:.1f} s after the kill")  # fmt: skip
    if member:  # no session timeout to wait out (6 s here): it assigns itself at start
        assert back_s < 6.0, back_s


def scrape(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(line.split()[-1]) for line in body.splitlines() if line.startswith(name + " "))


@pytest.mark.slow
@pytest.mark.parametrize("static", [False, True], ids=["group", "static"])
def test_two_joiners_split_the_partitions(kafka, tmp_path, static):
    cfg = topics(kafka, f"split-{static}")
    cfg.kafka_config = short_session(tmp_path)  # a member joining a running group: the rebalance delay
    ports = [free_port(), free_port()]
    reader = TopicReader(kafka.bootstrap, cfg.samples, PARTS)

    def assigned(i):
        lines = [
            ln for ln in (tmp_path / f"join-{i}.log").read_text().splitlines() if "assigned partitions" in ln
        ]
        return json.loads(lines[-1].rsplit("partitions", 1)[1]) if lines else None  # "[0, 1]"

    def start(i):
        return spawn(
            join_args(replace(cfg, member=f"{i}/2" if static else ""), ports[i]), tmp_path / f"join-{i}.log"
        )

    procs = [start(0)]
    try:
        if not static:  # the second joins a running group: the first gives half back in a rebalance
            wait_until(
                lambda: assigned(0) == list(range(PARTS)), 60, "the first joiner holding every partition"
            )
        procs.append(start(1))
        wait_until(lambda: all(assigned(i) for i in (0, 1)) and sorted(assigned(0) + assigned(1)) == list(range(PARTS)),
                   60, "both joiners assigned, the partitions split between them")  # fmt: skip
        if static:
            assert [assigned(0), assigned(1)] == [[0, 2], [1, 3]]
        due = workload(kafka, cfg, range(100))
        wait_until(
            lambda: reader.poll() and set(samples_by_key(reader)) >= set(due), 60, "every sample joined"
        )
        counts = [scrape(p, "recserve_join_impressions_total") for p in ports]
        assert all(c > 0 for c in counts) and sum(counts) == 100, counts
    finally:
        stop_children(procs)
        reader.close()
