"""Impressions read back by offset (``stream.readback``) against the mock Kafka cluster, and the
joiner's corrections through it: a click after the first horizon reaches the samples topic as a
correction of the item, built from its impression read back."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from prometheus_client import CollectorRegistry

from stream.config import kafka_settings
from stream.joiner import Joiner
from stream.readback import GAP, ImpressionReader
from tests.helpers import wait_until
from tests.stream.helpers import (
    N_ITEMS,
    PARTS,
    TopicReader,
    event,
    impression,
    produce,
    samples_by_key,
    topics,
)


def test_offsets_are_read_back_in_runs_and_those_the_partition_lacks_are_none(kafka):
    topic = kafka.create_topic("readback-one", 1)
    produce(kafka.bootstrap, topic, [("k", f"record {i}".encode()) for i in range(GAP + 10)])
    reader = ImpressionReader({"bootstrap.servers": kafka.bootstrap, **kafka_settings("")}, topic)
    try:
        far = GAP + 9  # after a seek: further than GAP from the run before it
        got = reader.read(0, [3, 0, far, 3, GAP + 50])
        assert got == {0: b"record 0", 3: b"record 3", far: f"record {far}".encode(), GAP + 50: None}
    finally:
        reader.close()


def test_a_click_after_the_first_horizon_is_corrected_from_its_impression_read_back(kafka):
    cfg = replace(topics(kafka, "late-clicks"), label_after_s=1.0, attribution_s=3600.0)
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
    assert not joiner.fatal
