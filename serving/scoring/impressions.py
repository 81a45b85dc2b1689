"""The impression log: every scored request, as one ``stream.records.Impression`` on a
Kafka topic (``--log-impressions kafka://BROKERS/TOPIC``), off the request path.

The request loop (``serving.scoring.loop.complete``) offers each scored request once, after its
encode: the request id, the versions that scored it, the compact batch exactly as scored and its
scores. ``offer`` only appends to a bounded queue (no I/O, no encoding); one background thread
encodes the records (a JSON request's batch through ``features.codec.encode`` there, a binary
request's bytes as they came) and hands them to a confluent-kafka ``Producer`` that batches and
lingers. When Kafka is slow or down the queue fills, or librdkafka's buffer does, or a delivery
times out: the record is dropped and counted (``dropped``; ``recserve_impressions_dropped_total``
on the frontends' /metrics), and the request it came from was answered as if logging were off.

The request id is the client's ``X-Request-Id`` header, else one made here (``request_id``); both
frontends return it in the response's ``X-Request-Id`` header.

An experiment's shadow arm (``serving.scoring.shadow``) scores a request off the response path; its
impression (versions stamped ``"shadow": true``) goes to the topic ``<topic>.shadow``, never to the
impression topic the joiner reads: no event names its request id (``<request id>#shadow-<arm>``),
so joined it would teach the model negatives only, and its request was served and logged already.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np

from features.codec import encode
from serving.scoring.decoding import Request
from stream.records import Impression, Versions, encode_impression

log = logging.getLogger("recserve.impressions")

HEADER = "X-Request-Id"
DROPPED = "recserve_impressions_dropped_total"
LOGGED = "recserve_impressions_logged_total"


def request_id(sent: str | bytes | None) -> str:
    """The client's request id when it sent one, else a new one (32 hex digits)."""
    if isinstance(sent, bytes):
        sent = sent.decode("latin-1")
    return sent if sent else uuid.uuid4().hex


@dataclass(frozen=True)
class Target:
    """Where impressions go: ``kafka://host:port[,host:port...]/topic``."""

    brokers: str
    topic: str

    @classmethod
    def parse(cls, url: str) -> Target:
        scheme, sep, rest = url.partition("://")
        brokers, _, topic = rest.partition("/")
        if scheme != "kafka" or not sep or not brokers or not topic or "/" in topic:
            raise ValueError(f"--log-impressions {url!r}: expected kafka://BROKERS/TOPIC "
                             "(BROKERS host:port[,host:port...])")  # fmt: skip
        return cls(brokers, topic)


class ImpressionLog:
    """A bounded queue of scored requests drained into Kafka by one background thread.

    ``capacity`` bounds the queue (the requests waiting to be encoded: their batches are held);
    librdkafka's own buffer is bounded by ``buffer_mb`` (a 200-item impression is tens of KB, so
    it bounds before librdkafka's count of 100,000 does); a record not delivered within
    ``delivery_timeout_s`` is dropped by librdkafka and counted here."""

    def __init__(self, url: str, capacity: int = 2000, buffer_mb: int = 64, delivery_timeout_s: float = 10.0,
                 linger_ms: float = 5.0) -> None:  # fmt: skip
        from confluent_kafka import Producer

        self.target = Target.parse(url)
        self.shadow_topic = f"{self.target.topic}.shadow"
        """Where shadow arms' impressions go (the joiner does not read them)."""
        self._counts = {self.target.topic: [0, 0], self.shadow_topic: [0, 0]}  # topic -> [dropped, logged]
        self._queue: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._capacity = capacity
        self._last_error = ""
        self._lock = threading.Lock()  # the counters: offered on request threads, settled on the drain
        self._producer = Producer({
            "bootstrap.servers": self.target.brokers, "linger.ms": linger_ms,
            "queue.buffering.max.kbytes": buffer_mb << 10, "message.timeout.ms": int(delivery_timeout_s * 1e3),
            "acks": "all", "enable.idempotence": False, "compression.type": "lz4", "log_level": 3,
            "error_cb": self._error,
        })  # fmt: skip
        self._closed = False
        self._thread = threading.Thread(target=self._drain, name="impression-log", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Records of the impression topic dropped: queue full, librdkafka's buffer full, or not
        delivered in time."""
        return self._counts[self.target.topic][0]

    @property
    def logged(self) -> int:
        """Records of the impression topic the broker acknowledged."""
        return self._counts[self.target.topic][1]

    # --- the request path ------------------------------------------------------------------------
    def offer(self, rid: str, request: Request, scores: np.ndarray, versions: dict[str, Any]) -> None:
        """Queue one scored request (constant time; never blocks, never raises for Kafka); a
        shadow arm's (``versions["shadow"]``) for the shadow topic."""
        topic = self.shadow_topic if versions.get("shadow") else self.target.topic
        if self._queue.qsize() >= self._capacity:
            self._drop(1, topic)
            return
        self._queue.put((rid, time.time(), request, scores, versions, topic))

    # --- the drain -------------------------------------------------------------------------------
    def _drain(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                self._producer.poll(0.05)  # idle: serve delivery reports (they settle the counters)
                continue
            if item is None:
                return
            rid, ts, request, scores, v, topic = item
            batch = request.wire if request.wire is not None else encode(request.batch)
            record = encode_impression(Impression(rid, ts, Versions(v["embedding"], v["delta_seq"], v["dense"]),
                                                  np.asarray(scores, np.float32), batch, v.get("arm", "")))  # fmt: skip
            try:
                self._producer.produce(topic, record, rid.encode(), on_delivery=self._delivered)
            except BufferError:  # librdkafka's buffer is full: Kafka is slow or down
                self._drop(1, topic)
            self._producer.poll(0)

    def _delivered(self, err: Any, msg: Any) -> None:
        topic = msg.topic() if msg is not None and msg.topic() in self._counts else self.target.topic
        if err is not None:
            self._drop(1, topic)
            return
        with self._lock:
            self._counts[topic][1] += 1

    def _drop(self, n: int, topic: str = "") -> None:
        with self._lock:
            self._counts[topic or self.target.topic][0] += n

    def _error(self, err: Any) -> None:
        code = str(err.code()) if hasattr(err, "code") else str(err)
        if code != self._last_error:  # librdkafka repeats an error at every reconnect: say it once
            self._last_error = code
            log.warning("impression log %s/%s: %s (records are dropped and counted until it is delivered "
                        "again)", self.target.brokers, self.target.topic, err)  # fmt: skip

    def collect(self) -> list[Any]:
        """The counters as Prometheus metrics (registered on a frontend's registry: ``/metrics``)."""
        from prometheus_client.core import CounterMetricFamily

        dropped = CounterMetricFamily(DROPPED[: -len("_total")], "Impressions dropped (Kafka slow or down)",
                                      labels=["topic"])  # fmt: skip
        logged = CounterMetricFamily(LOGGED[: -len("_total")], "Impressions the broker acknowledged",
                                     labels=["topic"])  # fmt: skip
        with self._lock:
            for topic, (d, n) in self._counts.items():
                if topic == self.target.topic or d or n:  # the shadow topic once it is used
                    dropped.add_metric([topic], d)
                    logged.add_metric([topic], n)
        return [dropped, logged]

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the drain and deliver what is buffered within ``timeout_s``; what is not, counts as
        dropped (of the impression topic)."""
        if self._closed:
            return
        self._queue.put(None)
        self._thread.join(timeout_s)
        left = self._producer.flush(timeout_s)
        self._drop(left)
        self._closed = True
        if not self._thread.is_alive():
            # the handle goes now, not at a garbage collection: its error_cb holds this log, so
            # the two make a cycle, and until then librdkafka dials a down broker every second
            del self._producer
