"""The one dead-letter convention (``stream.dead_letter``): the topic name rule and the headers,
read back as written; the joiner's topics by the rule, or one topic for both inputs."""

from __future__ import annotations

import pytest

from stream import dead_letter
from stream.config import JoinConfig


def test_the_dead_letter_topic_of_a_topic():
    assert dead_letter.topic_of("samples") == "samples.dead"
    assert dead_letter.topic_of("impressions") == "impressions.dead"


def test_headers_say_why_and_where_and_read_back():
    written = dead_letter.headers("event: not JSON", "events", 3, 1234)
    assert written == [
        ("reason", b"event: not JSON"),
        ("topic", b"events"),
        ("partition", b"3"),
        ("offset", b"1234"),
    ]
    got = dead_letter.read_headers([*written, ("other", b"x")])
    assert got == {"reason": "event: not JSON", "topic": "events", "partition": "3", "offset": "1234"}
    assert dead_letter.read_headers(None) == {}


def test_the_joiners_dead_letter_topics():
    assert JoinConfig().dead_letters() == ("impressions.dead", "events.dead")
    assert JoinConfig(impressions="imp", events="ev").dead_letters() == ("imp.dead", "ev.dead")
    assert JoinConfig(dead_letter="join-dead-letter").dead_letters() == ("join-dead-letter",) * 2
    with pytest.raises(ValueError, match="distinct"):
        JoinConfig(dead_letter="samples")
