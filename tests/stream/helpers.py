"""Records for the stream tests: impressions of a ranking request and click events."""

from __future__ import annotations

import numpy as np

from features.codec import encode
from stream import dead_letter
from stream.config import JoinConfig
from stream.records import Event, Impression, Versions, encode_event, encode_impression
from tests.serving.helpers import ITEMS, ranking_batch

BATCH = encode(ranking_batch())
N_ITEMS = len(ITEMS)


def impression(rid: str, ts: float) -> bytes:
    scores = np.linspace(0, 1, N_ITEMS, dtype=np.float32)
    return encode_impression(Impression(rid, ts, Versions("v1", 0, "v1"), scores, BATCH))


def impression_record(rid: str = "r-1", ts: float = 100.0) -> Impression:
    """An impression of the ranking request, decoded (versions v1, delta 3, v1; scores 0, 1/4, ...)."""
    return Impression(rid, ts, Versions("v1", 3, "v1"), np.arange(N_ITEMS, dtype=np.float32) / N_ITEMS, BATCH)


def event(rid: str, item: int, ts: float, label: float = 1.0) -> bytes:
    return encode_event(Event(rid, item, label, ts))


class TopicReader:
    """Every record of a topic from its beginning (all partitions assigned, no group), read on
    each ``poll``: ``records`` holds (key, value, headers) in arrival order."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{topic}",
                                  "enable.auto.commit": False})  # fmt: skip
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        self.records: list[tuple[bytes, bytes, dict]] = []

    def poll(self) -> int:
        for m in self.consumer.consume(10_000, timeout=0.2):
            if m.error() is None:
                self.records.append((m.key(), m.value(), dict(m.headers() or [])))
        return len(self.records)

    def close(self) -> None:
        self.consumer.close()


def produce(bootstrap: str, topic: str, records: list[tuple[str, bytes]]) -> None:
    from loadtest.stream_users import produce as produce_all

    produce_all(bootstrap, topic, records)


def samples_by_key(reader: TopicReader) -> dict[tuple, list[float]]:
    """Every sample's labels by (request, item), a correction's by (request, item, CORRECTION): more
    than one label = produced more than once."""
    from stream.records import LABEL, decode_sample

    out: dict[tuple, list[float]] = {}
    for _, value, _ in reader.records:
        s = decode_sample(value)
        out.setdefault(s.key[:2] if s.kind == LABEL else s.key, []).append(s.label)
    return out


PARTS = 4


def topics(kafka, name: str) -> JoinConfig:
    """Fresh topics named after the test (the inputs' dead-letter topics by the convention's rule),
    and a joiner's config over them."""
    names = {k: kafka.create_topic(f"{name}-{k}", PARTS) for k in ("impressions", "events", "samples")}
    for k in ("impressions", "events"):
        kafka.create_topic(dead_letter.topic_of(names[k]), PARTS)
    kafka.create_topic(names["samples"] + ".quarantine", PARTS)
    return JoinConfig(brokers=kafka.bootstrap, impressions=names["impressions"], events=names["events"],
                      samples=names["samples"], group=f"{name}-join", label_after_s=1.0,
                      commit_every_s=0.2)  # fmt: skip


def short_session(directory) -> str:
    """A librdkafka config file in ``directory`` with a 6 s session timeout (45 s by default), for
    a joiner in a group: the mock cluster notices a dead member after it, and holds a member joining
    a group it knew (even one the last member left) for its rebalance delay, the session timeout
    less 1 s (a real broker goes on once every member has rejoined). Its path."""
    path = directory / "kafka.conf"
    path.write_text("session.timeout.ms=6000\nheartbeat.interval.ms=500\n")
    return str(path)


def join_args(cfg: JoinConfig, metrics_port: int = 0) -> list[str]:
    return ["join", "--kafka-config", cfg.kafka_config, "--brokers", cfg.brokers, "--impressions", cfg.impressions, "--events", cfg.events,
            "--samples", cfg.samples, "--group", cfg.group,
            "--label-after-s", str(cfg.label_after_s), "--commit-every-s", str(cfg.commit_every_s),
            "--metrics-port", str(metrics_port)] + (["--member", cfg.member] if cfg.member else []) + (
            ["--dead-letter", cfg.dead_letter] if cfg.dead_letter else []) + (
            ["--attribution-s", str(cfg.attribution_s), "--state-dir", cfg.state_dir] if cfg.attribution_s else [])  # fmt: skip
