"""``recserve join --replay-quarantine``: move the samples the input guard quarantined to the
samples topic, once an operator judged them good.

A consumer group of its own (``<group>.replay``) reads the quarantine topic from its committed
offsets to the end of every partition, produces each record unchanged (key, value) to the samples
topic, and commits only what the broker acknowledged; it exits when it reached the end. A replay
that is stopped or fails resumes where its last commit was; a sample replayed twice is trained
once (the trainer drops a key it already trained).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from stream.config import FETCH_WAIT_MS, JoinConfig, kafka_settings

log = logging.getLogger("recserve.join")


class ReplayError(RuntimeError):
    """The replay cannot run (the topics are missing) or a sample was not delivered."""


@dataclass
class Replayed:
    samples: int = 0
    partitions: int = 0


def replay(cfg: JoinConfig, timeout_s: float = 10.0) -> Replayed:
    """Move the quarantine topic's records from the replay group's offsets to its end into the
    samples topic; what was moved (ReplayError if a delivery failed: nothing of it committed)."""
    source, group = cfg.quarantine_topic(), cfg.group + ".replay"
    common = {"bootstrap.servers": cfg.brokers, **kafka_settings(cfg.kafka_config)}
    consumer = Consumer({"group.id": group, "enable.auto.commit": False, "auto.offset.reset": "earliest",
                         "enable.partition.eof": True, "fetch.wait.max.ms": FETCH_WAIT_MS, **common})  # fmt: skip
    producer = Producer({"enable.idempotence": True, "linger.ms": 5, **common})
    try:
        topics = consumer.list_topics(timeout=timeout_s).topics
        missing = [t for t in (source, cfg.samples) if t not in topics or topics[t].error is not None]
        if missing:
            raise ReplayError(f"topics {missing} do not exist at {cfg.brokers}")
        parts = [TopicPartition(source, p) for p in topics[source].partitions]
        committed = consumer.committed(parts, timeout=timeout_s)
        consumer.assign([TopicPartition(source, tp.partition, tp.offset) for tp in committed])
        out, failed = Replayed(partitions=len(parts)), list[str]()
        done: set[int] = set()
        while len(done) < len(parts):
            msgs = consumer.consume(cfg.batch, timeout=1.0)
            marks: dict[int, int] = {}
            for m in msgs:
                err = m.error()
                if err is not None:
                    if err.code() != KafkaError._PARTITION_EOF:
                        raise ReplayError(f"consumer: {err.str()}")
                    done.add(m.partition())  # type: ignore[arg-type]
                    continue
                _produce(producer, cfg.samples, m, failed)
                marks[m.partition()] = m.offset() + 1  # type: ignore[index, operator]
                out.samples += 1
            producer.flush(30)
            if failed or len(producer):
                raise ReplayError(
                    f"a replayed sample was not delivered: {failed[0] if failed else 'timed out'}"
                )
            if marks:
                consumer.commit(
                    offsets=[TopicPartition(source, p, o) for p, o in marks.items()], asynchronous=False
                )
        return out
    except KafkaException as e:
        raise ReplayError(f"Kafka at {cfg.brokers}: {e.args[0].str()}") from None
    finally:
        consumer.close()


def _produce(producer: Producer, topic: str, m: Message, failed: list[str]) -> None:
    def delivered(err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            failed.append(err.str())

    while True:
        try:
            producer.produce(topic, m.value(), m.key(), on_delivery=delivered)
            return
        except BufferError:
            producer.poll(0.05)
