"""The requests a partition's join is done with, remembered for a while by event time: what tells
a click for a request whose attribution window is over (``late``) from a click for a request no
impression ever named (an ``unknown`` request: a dead letter with its reason).

A done request is kept as a 64-bit hash of its id (8 bytes; at 50 requests/s, an hour of them is
1.4 MB), in buckets by the event time it may be forgotten at, each an ``array('Q')`` that a lookup
reads as one numpy array (no loop per id). A lookup runs only for an event that finds no open or
settled request; a hash collision (one in 2**64 per pair) counts an unknown request's click late.
"""

from __future__ import annotations

import hashlib
import math
from array import array

import numpy as np

KNOWN_FOR_S = 3600.0
"""The least event time a join remembers a request it is done with (``stream.join``: twice the
attribution window, at least this): a click that long after its impression is late, not a dead
letter. Without ``--attribution-s`` the window is ``--label-after-s``, seconds, and a late click
of a few seconds more was dead-lettered as a click for an unknown request (bench-delayed's
drop-late arm: 12,000 of its 24,000 clicks). An hour of a partition's requests at 50 requests/s
is 1.4 MB."""
BUCKETS = 32
"""Buckets over the memory's horizon: a lookup reads each, an expiry drops whole ones."""


def _hash(rid: str) -> int:
    return int.from_bytes(hashlib.blake2b(rid.encode(), digest_size=8).digest(), "little")


class DoneRequests:
    """The requests a join is done with, each remembered for ``horizon_s`` of event time past its
    impression (``add``), and how far back the join knows every impression (``seen``)."""

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s, self.bucket_s = horizon_s, max(horizon_s / BUCKETS, 1e-3)
        self._buckets: dict[int, array[int]] = {}
        self.seen_from = math.inf  # event time from which every impression is known (read or restored)

    def seen(self, ts: float) -> None:
        """The join read (or restored) an impression of ``ts``."""
        self.seen_from = min(self.seen_from, ts)

    def add(self, rid: str, ts: float) -> None:
        """The join is done with request ``rid``, impressed at ``ts``."""
        key = math.floor((ts + self.horizon_s) / self.bucket_s)
        self._buckets.setdefault(key, array("Q")).append(_hash(rid))

    def unknown(self, rid: str, ts: float) -> str:
        """Why an event of ``ts`` that no open request takes names an unknown request ("": it may be
        a late click of a request done with, or the join has not seen that far back)."""
        if ts - self.horizon_s < self.seen_from or rid in self:
            return ""
        return f"no impression of request {rid!r} in the {self.horizon_s:g} s before it"

    def __contains__(self, rid: str) -> bool:
        h = np.uint64(_hash(rid))
        return any(bool((np.frombuffer(b, np.uint64) == h).any()) for b in self._buckets.values() if len(b))

    def expire(self, watermark: float) -> None:
        """Forget the ids whose time passed (to the bucket: kept up to one bucket longer)."""
        if not math.isfinite(watermark) or not self._buckets:
            return
        last = math.floor(watermark / self.bucket_s)
        for key in [k for k in self._buckets if k < last]:  # a loop per bucket, not per id
            del self._buckets[key]

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())
