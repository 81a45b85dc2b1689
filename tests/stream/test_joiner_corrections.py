"""The joiner's corrections against the mock Kafka cluster: a click after the first horizon reaches
the samples topic as a correction of the item, built from its impression spilled to disk; the
spill's directory is gone when the joiner stops."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from prometheus_client import CollectorRegistry

from stream.joiner import Joiner
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
