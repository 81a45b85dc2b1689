"""``kafka``: one mock Kafka cluster (``serving.stream.mockbroker``, a child process) for the
session's stream tests; each test creates its own topics (``kafka.create_topic``)."""

from __future__ import annotations

import pytest

from serving.stream import mockbroker


@pytest.fixture(scope="session")
def kafka():
    with mockbroker.running() as broker:
        yield broker
