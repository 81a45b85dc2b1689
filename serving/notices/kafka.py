"""``kafka://BROKERS/TOPIC``: notices on one Kafka topic per model (any number of hosts).

The announcer hands each notice (key: the model) to librdkafka and goes on; one the broker does not
acknowledge within ``TIMEOUT_S`` is logged and counted in ``failed`` (serving catches the delta up
at its next poll), and ``close`` waits for the acknowledgements of those in flight.

Each listening process has a consumer of its own: every partition assigned at its end (a notice
older than the process is the start-up poll's business), no group membership and no commits, so
every process sees every notice, as HugeCTR's HPS has every node read its update topic. A fetch
waits ``fetch.wait.max.ms`` = 10 ms at most: a broker answers a waiting fetch as soon as a record
arrives anyway, but librdkafka's mock cluster answers only when the wait ends. Nagle is off on
both sides: a notice is one small packet, not to be held back for the last one's acknowledgement.
"""

from __future__ import annotations

import logging
import threading
import uuid
from pathlib import Path

from serving.notices.hub import Notices
from serving.notices.record import Notice, encode
from serving.notices.registry import Transport, register

log = logging.getLogger("recserve.notices")

TIMEOUT_S = 5.0
RETRY_S = 2.0  # a topic not found yet, a broker not reachable: looked up again after this


def parse(where: str) -> tuple[str, str]:
    """(brokers, topic) of ``BROKERS/TOPIC``."""
    brokers, sep, topic = where.rpartition("/")
    if not sep or not brokers or not topic:
        raise ValueError(f"kafka://{where}: expected kafka://BROKERS/TOPIC (host:port[,host:port...]/topic)")
    return brokers, topic


class KafkaAnnouncer:
    def __init__(self, where: str):
        from confluent_kafka import Producer

        self.brokers, self.topic = parse(where)
        self.failed = 0
        """Notices not acknowledged within ``TIMEOUT_S`` (each logged)."""
        self._producer = Producer({"bootstrap.servers": self.brokers, "linger.ms": 0, "acks": "all",
                                   "message.timeout.ms": int(TIMEOUT_S * 1000), "socket.nagle.disable": True,
                                   "log_level": 3})  # fmt: skip

    def announce(self, notice: Notice) -> None:
        """Hand ``notice`` to librdkafka, which sends it at once on its own thread: the writer never
        waits on the broker (a broker down costs it nothing but the notices, counted)."""
        from confluent_kafka import KafkaException

        try:
            self._producer.produce(self.topic, encode(notice), notice.model.encode(),
                                   on_delivery=lambda err, _msg: self._delivered(err, notice))  # fmt: skip
        except (BufferError, KafkaException) as e:
            self._delivered(e, notice)
        self._producer.poll(0)  # the delivery reports of earlier notices

    def _delivered(self, err, notice: Notice) -> None:
        if err is not None:
            self.failed += 1
            log.error("notice %s not delivered to kafka://%s/%s (%s): serving catches it up at its next poll",
                      notice, self.brokers, self.topic, err)  # fmt: skip

    def close(self) -> None:
        """Wait (``TIMEOUT_S`` at most) until every notice is acknowledged or failed."""
        self._producer.flush(TIMEOUT_S + 1)


class KafkaListener:
    def __init__(self, where: str, notices: Notices):
        from confluent_kafka import Consumer

        self.brokers, self.topic = parse(where)
        self.notices = notices
        self.assigned = threading.Event()
        """Set once the topic's partitions are assigned: notices from then on are received."""
        self._consumer = Consumer({
            "bootstrap.servers": self.brokers, "group.id": f"recserve-notices-{uuid.uuid4().hex}",
            "enable.auto.commit": False, "fetch.wait.max.ms": 10, "socket.nagle.disable": True, "log_level": 3,
        })  # fmt: skip
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="notices-kafka", daemon=True)
        self._thread.start()

    @property
    def listening(self) -> bool:
        return self.assigned.is_set()

    def _assign(self) -> bool:
        from confluent_kafka import OFFSET_END, KafkaException, TopicPartition

        try:
            meta = self._consumer.list_topics(self.topic, timeout=TIMEOUT_S).topics[self.topic]
        except KafkaException as e:
            log.warning("notices: kafka://%s/%s not reachable (%s): polling only until it is",
                        self.brokers, self.topic, e)  # fmt: skip
            return False
        if meta.error is not None or not meta.partitions:
            log.warning("notices: topic %s on %s: %s: polling only until it exists", self.topic,
                        self.brokers, meta.error or "no partitions")  # fmt: skip
            return False
        self._consumer.assign([TopicPartition(self.topic, p, OFFSET_END) for p in meta.partitions])
        self.assigned.set()
        log.info("notices: listening on kafka://%s/%s (%d partitions)", self.brokers, self.topic,
                 len(meta.partitions))  # fmt: skip
        return True

    def _run(self) -> None:
        while not self._stop.is_set() and not self._assign():
            self._stop.wait(RETRY_S)
        while not self._stop.is_set():
            msg = self._consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error() is not None:
                log.warning("notices: kafka://%s/%s: %s", self.brokers, self.topic, msg.error())
                continue
            self.notices.received(msg.value())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._consumer.close()


def _listen(where: str, model_dir: Path, notices: Notices) -> KafkaListener:
    return KafkaListener(where, notices)


register(Transport("kafka", _listen, KafkaAnnouncer, parse))
