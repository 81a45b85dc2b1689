"""Dead letters: the one convention of every consumer of the loop's topics (``recserve join``, the
streaming trainer's ``kafka://`` source).

A record a consumer cannot use (malformed, of another schema, naming an item its request does not
have) goes unchanged, key and value, to the dead-letter topic of the topic it was read from,
``<topic>.dead`` (``impressions.dead``, ``events.dead``, ``samples.dead``), with four headers:

========== =====================================================
header     value (UTF-8)
========== =====================================================
reason     why it was refused, in words
topic      the topic it was read from
partition  its partition there, a decimal number
offset     its offset there, a decimal number
========== =====================================================

The consumer counts it and goes on; the input offset past it counts only once the dead letter is
acknowledged. The joiner's ``--dead-letter TOPIC`` sends both inputs' dead letters to one topic
instead, with the same headers."""

from __future__ import annotations

SUFFIX = ".dead"
HEADERS = ("reason", "topic", "partition", "offset")


def topic_of(topic: str) -> str:
    """The dead-letter topic of records read from ``topic``."""
    return topic + SUFFIX


def headers(reason: str, topic: str, partition: int, offset: int) -> list[tuple[str, str | bytes | None]]:
    """A dead letter's headers: why, and where it was read (``HEADERS``, in that order), as
    confluent-kafka's ``produce`` takes them."""
    values = (reason, topic, str(int(partition)), str(int(offset)))
    return [(name, value.encode()) for name, value in zip(HEADERS, values, strict=True)]


def read_headers(pairs: list[tuple[str, bytes | None]] | None) -> dict[str, str]:
    """The convention's headers of a consumed dead letter (``Message.headers()``), decoded."""
    return {k: (v or b"").decode() for k, v in pairs or [] if k in HEADERS}
