"""Records for the stream tests: impressions of a ranking request and click events."""

from __future__ import annotations

import numpy as np

from features.codec import encode
from serving.stream.records import Event, Impression, Versions, encode_event, encode_impression
from tests.serving.helpers import ITEMS, ranking_batch

BATCH = encode(ranking_batch())
N_ITEMS = len(ITEMS)


def impression(rid: str, ts: float) -> bytes:
    scores = np.linspace(0, 1, N_ITEMS, dtype=np.float32)
    return encode_impression(Impression(rid, ts, Versions("v1", 0, "v1"), scores, BATCH))


def event(rid: str, item: int, ts: float, label: float = 1.0) -> bytes:
    return encode_event(Event(rid, item, label, ts))
