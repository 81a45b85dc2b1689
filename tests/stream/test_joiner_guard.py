"""The input guard in a running joiner (mock Kafka cluster): clicks stop while impressions flow;
the guard trips, the join holds its windows and emits nothing from the outage; the same clicks,
delayed, label it right once they come; an outage whose clicks never come ends in the quarantine
topic, counted, and ``recserve join --replay-quarantine`` moves it to the samples topic."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry

from model_store.guards import read_guards
from stream.guard import GuardConfig
from stream.joiner import Joiner
from stream.records import LABEL, decode_sample
from tests.helpers import wait_until
from tests.stream.helpers import N_ITEMS, PARTS, TopicReader, event, impression, join_args, produce, topics

GUARD = GuardConfig(window_s=1.0, band_s=20.0, min_items=40, warmup_items=200, hold_s=5.0, max_lag_s=1000.0)
"""hold_s: the windows due in the second before the trip (held since by --events-idle-s) must not
reach the bound in the 2 s the clear takes after it."""


class Traffic:
    """Requests every 50 ms, each clicked on item r % N_ITEMS 0.1 s after it is scored; while
    ``clicks`` is clear, the clicks are kept back (``withheld``) instead of sent."""

    def __init__(self, kafka, cfg) -> None:
        self.kafka, self.cfg, self.sent = kafka, cfg, 0
        self.clicks, self.stop = threading.Event(), threading.Event()
        self.clicks.set()
        self.withheld: list[tuple[str, bytes]] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def resume(self) -> list[tuple[str, bytes]]:
        """Send clicks again; the clicks withheld until then (every one: the request in flight when
        they resume has its click sent or withheld before this returns)."""
        self.clicks.set()
        sent = self.sent
        wait_until(lambda: self.sent >= sent + 2, 10, "a request after the clicks resumed")
        withheld, self.withheld = self.withheld, []
        return withheld

    def _run(self) -> None:
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": self.kafka.bootstrap, "linger.ms": 5})
        while not self.stop.wait(0.05):
            now, rid = time.time(), f"r{self.sent}"
            producer.produce(self.cfg.impressions, impression(rid, now), rid)
            click = (rid, event(rid, self.sent % N_ITEMS, now + 0.1))
            if self.clicks.is_set():
                producer.produce(self.cfg.events, click[1], rid)
            else:
                self.withheld.append(click)
            producer.poll(0)
            self.sent += 1
        assert producer.flush(30) == 0


@pytest.mark.slow
def test_an_outage_of_clicks_is_held_labelled_late_or_quarantined_and_replayed(kafka, tmp_path):
    cfg = replace(topics(kafka, "guard"), guard=GUARD, label_after_s=4.0,  # longer than the guard takes to trip
                  record_to=str(tmp_path))  # fmt: skip
    joiner = Joiner(cfg, CollectorRegistry())
    joiner.check_topics()
    stop, traffic = threading.Event(), Traffic(kafka, cfg)
    thread = threading.Thread(target=joiner.run, args=(stop,), daemon=True)
    samples = TopicReader(kafka.bootstrap, cfg.samples, PARTS)
    quarantine = TopicReader(kafka.bootstrap, cfg.quarantine_topic(), PARTS)
    try:
        thread.start()
        traffic.thread.start()
        wait_until(lambda: joiner.counts.items >= 2 * GUARD.warmup_items, 30, "a band of healthy traffic")
        assert not joiner.guard.tripped
        # 1. clicks stop; they come back late, the same clicks: every one labels its item
        traffic.clicks.clear()
        wait_until(lambda: joiner.guard.tripped, 10, "the guard tripped")
        assert joiner.guard.trip.measure == "label_rate"
        outage = traffic.sent
        wait_until(lambda: traffic.sent >= outage + 20, 10, "more impressions during the outage")
        produce(kafka.bootstrap, cfg.events, traffic.resume())
        wait_until(lambda: not joiner.guard.tripped, 10, "the guard cleared")
        assert joiner.guard.recoveries == 1 and joiner.counts.quarantined == 0
        # 2. clicks stop and never come: the held windows go to quarantine at the hold's bound
        traffic.clicks.clear()
        wait_until(lambda: joiner.guard.tripped, 10, "the guard tripped again")
        wait_until(lambda: joiner.counts.quarantined >= 10 * N_ITEMS, 20, "windows quarantined at the bound")
        dropped = {rid for rid, _ in traffic.resume()}  # clicks never sent: their items are negatives
        wait_until(lambda: not joiner.guard.tripped, 10, "the guard cleared again")
        traffic.stop.set()
        traffic.thread.join(30)
        wait_until(lambda: sum(p.open_windows for p in joiner.parts.values()) == 0, 20, "every window closed")
        stop.set()
        thread.join(30)
        quarantined = joiner.counts.quarantined
        wait_until(lambda: quarantine.poll() >= quarantined, 20, "the quarantined samples on their topic")
        assert all(h["reason"].startswith(b"input guard: label rate") for _, _, h in quarantine.records)
        samples.poll()
        labels = {}
        for _, value, _ in samples.records:
            s = decode_sample(value)
            assert s.key not in labels, f"{s.key} sampled twice"
            labels[s.key] = s.label
        held = {decode_sample(v).key for _, v, _ in quarantine.records}
        assert not held & labels.keys()
        # every request of the first outage (and all others not quarantined) labelled as clicked
        for r in range(traffic.sent):
            for k in range(N_ITEMS):
                key = (f"r{r}", k, LABEL)
                assert (key in labels) != (key in held), key
                if key in labels:
                    assert labels[key] == float(k == r % N_ITEMS and key[0] not in dropped), key
        recorded = read_guards(tmp_path)[0]
        assert [(e.guard, e.event) for e in recorded] == [("input", "trip"), ("input", "clear")] * 2
        for e in recorded:  # a trip says why it tripped, a clear why it cleared
            why = "is under 0.25 x its band" if e.event == "trip" else "is back at >= 0.5 x its band"
            assert e.reason.startswith("label rate ") and why in e.reason, e.reason
        # 3. judged good: the replay moves them to the samples topic, once
        cmd = [sys.executable, "-m", "recserve", *join_args(cfg), "--replay-quarantine"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert f"replayed {len(held)} quarantined samples" in done.stdout
        again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert "replayed 0 quarantined samples" in again.stdout, again.stdout + again.stderr
        wait_until(lambda: samples.poll() >= len(labels) + len(held), 20, "the replayed samples")
        assert {decode_sample(v).key for _, v, _ in samples.records} == labels.keys() | held
    finally:
        traffic.stop.set()
        stop.set()
        samples.close()
        quarantine.close()
