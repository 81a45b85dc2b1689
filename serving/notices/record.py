"""The notice record and its one reader.

**Notice** (one JSON object, the one reader is ``decode``)::

    {"model": "criteo", "version": "3", "delta_seq": 7, "ts": 1767225600.25}

``delta_seq`` -1 (``VERSION``) names the version itself (``CURRENT`` moved to it), N >= 0 its delta
N; ``ts`` is when the marker was written (seconds since the epoch). No other keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import orjson

VERSION = -1
"""The delta_seq of a notice of a version itself (CURRENT moved to it): a full dump's seq."""


class NoticeError(ValueError):
    """A record that is not a notice; the message says what is wrong."""


@dataclass(frozen=True)
class Notice:
    model: str
    version: str
    delta_seq: int
    """-1: the version itself (CURRENT moved to it; the store's seq of a full dump); N >= 0: its
    delta N."""
    ts: float
    """When the marker was written (seconds since the epoch)."""


def encode(notice: Notice) -> bytes:
    return orjson.dumps({"model": notice.model, "version": notice.version, "delta_seq": notice.delta_seq,
                         "ts": notice.ts})  # fmt: skip


def decode(data: bytes | None) -> Notice:
    """The notice in ``data``; a ``NoticeError`` naming the problem otherwise."""
    try:
        d = orjson.loads(data or b"")
    except orjson.JSONDecodeError as e:
        raise NoticeError(f"not JSON: {e}") from None
    keys = {"model", "version", "delta_seq", "ts"}
    if not isinstance(d, dict) or set(d) != keys:
        got = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise NoticeError(f"expected an object with keys {sorted(keys)}, got {got}")
    model, version, seq, ts = d["model"], d["version"], d["delta_seq"], d["ts"]
    if not isinstance(model, str) or not model or not isinstance(version, str) or not version.isdigit():
        raise NoticeError(f"bad model {model!r} or version {version!r} (a version is a number, as a string)")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < VERSION:
        raise NoticeError(f"delta_seq must be an integer >= -1, got {seq!r}")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts):
        raise NoticeError(f"ts must be a finite number, got {ts!r}")
    return Notice(model, version, seq, float(ts))
