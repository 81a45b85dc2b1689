"""The joiner's corrections against the mock Kafka cluster: a click after the first horizon reaches
the samples topic as a correction of the item, built from its impression spilled to disk; the
spill's directory is gone when the joiner stops."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from serving.rpc.procs import spawn, stop_children
from stream.joiner import Joiner
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
    topics,
)


def test_a_click_after_the_first_horizon_is_corrected_from_its_impression_spilled(kafka, tmp_path):
    cfg = replace(
        topics(kafka, "late-clicks"),
        label_after_s=1.0,
        attribution_s=3600.0,
        state_dir=str(tmp_path / "join"),
    )
    t0 = time.time() - 60  # event time a minute ago: the first horizon is over as soon as it is read
    produce(kafka.bootstrap, cfg.impressions, [("a", impression("a", t0))])
    registry = CollectorRegistry()
    joiner = Joiner(cfg, registry)
    joiner.check_topics()
    stop = threading.Event()
    thread = threading.Thread(target=joiner.run, args=(stop,), daemon=True)
    thread.start()
    samples = TopicReader(kafka.bootstrap, cfg.samples, PARTS)

    def metric(name):
        return registry.get_sample_value(f"recserve_join_{name}_total")

    try:
        wait_until(lambda: samples.poll() >= N_ITEMS, 30, "a's first labels, every item negative")
        assert [f.stat().st_size for f in (tmp_path / "join").glob("*/*.seg")] == [len(impression("a", t0))]
        produce(
            kafka.bootstrap,
            cfg.events,
            [
                ("a", event("a", 2, t0 + 30.0)),  # 30 s late: a correction
                ("a", event("a", 2, t0 + 31.0)),  # the same click again
                ("a", event("a", 1, t0 + 4000.0)),
            ],
        )  # after the attribution window
        wait_until(lambda: samples.poll() >= N_ITEMS + 1 and metric("late_events") == 1, 30, "the correction")
        labels = samples_by_key(samples)
        assert labels == {**{("a", i): [0.0] for i in range(N_ITEMS)}, ("a", 2, 1): [1.0]}
        assert (metric("corrections"), metric("duplicate_events"), metric("corrections_lost")) == (1, 1, 0)
    finally:
        stop.set()
        thread.join(30)
        samples.close()
    assert not joiner.fatal and not list((tmp_path / "join").glob("*/*.seg"))  # its partitions' spills went


@pytest.mark.slow
def test_a_joiner_sigkilled_after_settling_resumes_from_its_journal_and_corrects_each_item_once(
    kafka, tmp_path
):
    cfg = replace(topics(kafka, "late-kill"), label_after_s=1.0, attribution_s=3600.0, member="0/1",
                  state_dir=str(tmp_path / "state"))  # fmt: skip
    t0 = time.time() - 60
    rids = [f"r{i}" for i in range(40)]
    produce(kafka.bootstrap, cfg.impressions, [(r, impression(r, t0 + i * 0.01)) for i, r in enumerate(rids)])
    samples = TopicReader(kafka.bootstrap, cfg.samples, PARTS)

    def journal_lines() -> list[bytes]:
        return [line for f in (tmp_path / "state").glob("*.journal") for line in f.read_bytes().splitlines()]

    def clicks(rs, item):
        produce(kafka.bootstrap, cfg.events, [(r, event(r, item, t0 + 30.0)) for r in rs])

    proc = spawn(join_args(cfg), tmp_path / "join-1.log")
    try:
        wait_until(lambda: len(journal_lines()) == 40, 60, "every request settled (first labels delivered)")
        clicks(rids[:20], 1)
        wait_until(
            lambda: len(journal_lines()) == 60, 60, "the first 20 corrections delivered and journalled"
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        port = free_port()
        proc = spawn(join_args(cfg, port), tmp_path / "join-2.log")
        clicks(rids[:20], 1)  # the same clicks again (a client's retry): corrected already
        clicks(rids[20:], 2)
        wait_until(lambda: samples.poll() >= 40 * N_ITEMS + 40, 60, "the other 20 corrections")
        wait_until(
            lambda: duplicates(port) == 20, 30, "the retried clicks counted duplicates (not the replayed)"
        )
    finally:
        stop_children([proc])
    samples.poll()
    samples.close()
    got = samples_by_key(samples)
    firsts = {(r, i): [0.0] for r in rids for i in range(N_ITEMS)}
    corrections = {(r, 1 if n < 20 else 2, 1): [1.0] for n, r in enumerate(rids)}
    assert got == {**firsts, **corrections}  # each first label and each correction exactly once


def duplicates(port: int) -> float:
    """The joiner's recserve_join_duplicate_events_total (-1 while it does not answer)."""
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return -1.0
    return sum(
        float(line.split()[-1])
        for line in body.splitlines()
        if line.startswith("recserve_join_duplicate_events_total ")
    )
