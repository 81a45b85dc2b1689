"""The impression log (serving/scoring/impressions.py) under ``recserve serve``'s app, in process,
against the mock Kafka cluster: each scored request is logged once, keyed by its request id (the
client's X-Request-Id, else a new one, answered in the response), with the versions and scores of
its response and the compact batch exactly as scored; with Kafka down, requests still answer 200
and the drops are counted on /metrics."""

from __future__ import annotations

import asyncio
import functools
import uuid
from pathlib import Path

import numpy as np
import orjson
import pytest

from features.codec import decode, encode
from serving.scoring import lean
from serving.scoring.asgi import App
from serving.scoring.client import requests_from_file
from serving.scoring.config import ScoringConfig
from serving.scoring.core import BINARY
from serving.scoring.impressions import ImpressionLog, Target, request_id
from serving.scoring.lean import Frontend, ServeConfig
from tests.helpers import wait_until
from tests.serving.helpers import TEST, consume_impressions

SCHEMA = "data/schemas/criteo.yaml"


def call(app: App, body: bytes, ctype: str, headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of one POST through the ASGI app."""
    scope = {"type": "http", "method": "POST", "path": "/predictions/criteo",
             "headers": [(b"content-type", ctype.encode()),
                         *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())]}  # fmt: skip
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(msg):
        sent.append(msg)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], dict(sent[0]["headers"]), sent[1]["body"]


def serving(root, url: str, batch_wait_ms: float = 0.0) -> tuple[Frontend, App]:
    config = ServeConfig(store=str(root), disable_token_auth=True, batch_wait_ms=batch_wait_ms,
                         scoring=ScoringConfig(lookups="colocated", log_impressions=url))  # fmt: skip
    frontend = Frontend(config)
    assert frontend.step() == "1"
    return frontend, App(frontend)


def test_target_and_request_id():
    assert Target.parse("kafka://a:1,b:2/imps") == Target("a:1,b:2", "imps")
    for bad in ("kafka://a:1", "http://a:1/t", "kafka:///t", "kafka://a:1/t/u"):
        with pytest.raises(ValueError, match="kafka://BROKERS/TOPIC"):
            Target.parse(bad)
    with pytest.raises(ValueError, match="kafka://BROKERS/TOPIC"):
        ScoringConfig(log_impressions="kafka://a:1")
    assert request_id(b"r-7") == "r-7"
    assert len({request_id(None), request_id(b""), request_id("")}) == 3  # each a new one


def test_a_full_queue_drops_and_counts_at_once():
    from serving.scoring.decoding import Request
    from tests.serving.helpers import ranking_batch

    log = ImpressionLog("kafka://127.0.0.1:1/imps", capacity=0)  # nothing is ever queued
    try:
        versions = {"embedding": "1", "delta_seq": 0, "dense": "1"}
        for i in range(5):
            log.offer(f"r-{i}", Request(ranking_batch()), np.zeros(3, np.float32), versions)
        assert log.dropped == 5  # counted on the request's thread, before it returns
    finally:
        log.close(0.1)


@pytest.mark.slow
@pytest.mark.parametrize("batch_wait_ms", [0.0, 1.0])
def test_each_request_is_logged_once_with_the_bytes_it_was_scored_on(trained, kafka, batch_wait_ms):
    topic = kafka.create_topic(f"imps-{uuid.uuid4().hex[:8]}")
    frontend, app = serving(trained[0], f"kafka://{kafka.bootstrap}/{topic}", batch_wait_ms)
    try:
        requests = list(requests_from_file(TEST, SCHEMA, 20, 60))  # 3 JSON requests of 20 items
        requests.append((requests_from_file(TEST, SCHEMA, 20, 20, binary=True).__next__()[0], BINARY))
        replies = {}
        for i, (body, ctype) in enumerate(requests):
            sent = {"X-Request-Id": f"client-{i}"} if i % 2 == 0 else None
            status, headers, payload = call(app, body, ctype, sent)
            assert status == 200, payload
            rid = headers[b"x-request-id"].decode()
            assert rid == f"client-{i}" if sent else len(rid) == 32  # honoured, else generated
            replies[rid] = (body, ctype, orjson.loads(payload))
        logged = {imp.request_id: imp for imp in consume_impressions(kafka.bootstrap, topic, len(requests))}
        assert sorted(logged) == sorted(replies)  # each once
        scorer = frontend.scorer
        assert scorer is not None
        for rid, (body, ctype, reply) in replies.items():
            imp = logged[rid]
            scored = scorer.decode(body, ctype)
            assert imp.batch == (body if ctype == BINARY else encode(scored.batch))  # the bytes scored
            back = decode(imp.batch, schema_hash=scorer.schema.hash64)
            assert np.array_equal(back.signs, scored.batch.signs)
            assert np.array_equal(back.dense, scored.batch.dense)
            assert np.array_equal(imp.scores, np.asarray(reply["scores"], np.float32))
            v = reply["versions"]
            assert (imp.versions.embedding, imp.versions.delta_seq, imp.versions.dense) == (
                v["embedding"], v["delta_seq"], v["dense"])  # fmt: skip
        log = frontend.impressions
        assert log is not None
        wait_until(lambda: log.logged == len(requests), 10, "every delivery acknowledged")
        assert log.dropped == 0
    finally:
        frontend.close()


def _librdkafka_threads() -> int:
    """Threads of this process that librdkafka runs (named ``rdk:...``)."""
    n = 0
    for task in Path("/proc/self/task").iterdir():
        try:
            n += (task / "comm").read_text().startswith("rdk:")
        except OSError:  # gone meanwhile
            pass
    return n


def test_close_lets_go_of_the_kafka_handle_at_once():
    """The handle goes with close(), not at a garbage collection (its error callback holds the
    log): no thread of it dials a down broker after."""
    before = _librdkafka_threads()
    log = ImpressionLog("kafka://127.0.0.1:1/imps", delivery_timeout_s=1.0)
    wait_until(lambda: _librdkafka_threads() > before, 10, "librdkafka's threads up")
    log.close(0.1)
    log.close(0.1)  # twice: nothing more to do
    wait_until(lambda: _librdkafka_threads() <= before, 10, "librdkafka's threads gone")
    assert log.dropped == 0


@pytest.mark.slow
def test_kafka_down_requests_answer_200_and_drops_are_counted(trained, monkeypatch):
    monkeypatch.setattr(lean, "ImpressionLog", functools.partial(ImpressionLog, delivery_timeout_s=1.0))
    frontend, app = serving(trained[0], "kafka://127.0.0.1:1/imps")  # nothing listens there
    try:
        n = 0
        for body, ctype in requests_from_file(TEST, SCHEMA, 20, 100):
            status, _, payload = call(app, body, ctype)
            assert status == 200, payload
            n += 1
        log = frontend.impressions
        assert log is not None
        wait_until(lambda: log.dropped == n, 30, f"{n} impressions dropped")
        status, metrics, _ = _get_metrics(app)
        assert status == 200 and f'recserve_impressions_dropped_total{{topic="imps"}} {float(n)}' in metrics
        assert log.logged == 0
    finally:
        frontend.close()


def _get_metrics(app: App) -> tuple[int, str, bytes]:
    scope = {"type": "http", "method": "GET", "path": "/metrics", "headers": []}
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(msg):
        sent.append(msg)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], sent[1]["body"].decode(), b""
