"""bench-guard's view of each input-guard clear (``loadtest.bench_guard``): what the joiner read
and produced, what the trainer trained and what was served, in buckets of wall time around it.

Per bucket (``STEP_S`` from ``BEFORE_S`` before the clear to ``AFTER_S`` after it):

- ``events_read``: events the joiner read (``recserve_join_events_total``);
- ``produced``, ``produced_label``: samples the joiner produced to the samples topic (their
  messages' timestamps) and their mean label; ``produced_pre_trip`` and ``pre_trip_label``: those
  of requests impressed before the trip (windows the guard held whose clicks came before the
  outage) and their mean label;
- ``trained``, ``trained_label``: samples the trainer trained (the offsets each delta recorded,
  ``recserve_follow_offset``) and their mean label;
- ``served_mean``: the probe's mean predicted CTR.
"""

from __future__ import annotations

import urllib.request

import numpy as np

STEP_S, BEFORE_S, AFTER_S = 5.0, 10.0, 60.0


def metrics(port: int) -> dict[str, float]:
    """Every sample line of 127.0.0.1:``port``/metrics (``name{labels}`` -> value); {} when the
    process does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=0.5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def offsets(page: dict[str, float], partitions: int) -> list[float]:
    """The trainer's offsets per samples partition, as its last delta recorded (0: none yet)."""
    return [page.get(f'recserve_follow_offset{{unit="samples/{p}"}}', 0.0) for p in range(partitions)]


def trained_at(t: np.ndarray, offs: np.ndarray, where: np.ndarray) -> np.ndarray:
    """When each sample at ``where`` (partition, offset) was first recorded trained: the first
    look ``t`` whose offset of its partition ``offs`` (looks x partitions) passed it (inf: never)."""
    out = np.full(len(where), np.inf)
    run = np.maximum.accumulate(offs, axis=0)  # a restart's lower offsets: trained already
    for p in range(offs.shape[1]):
        mine = where[:, 0] == p
        i = np.searchsorted(run[:, p], where[mine, 1], side="right")
        out[mine] = np.where(i < len(t), t[np.minimum(i, len(t) - 1)], np.inf)
    return out


def around(clear: float, trip: float, t: np.ndarray, served: np.ndarray, events: np.ndarray,
           joined: dict, trained: np.ndarray) -> list[dict]:  # fmt: skip
    """The buckets around one clear at wall time ``clear`` of a trip at ``trip``."""
    pre = joined["ts"] < trip
    rows = []
    for a in np.arange(clear - BEFORE_S, clear + AFTER_S, STEP_S):
        look = (t >= a) & (t < a + STEP_S)
        made = (joined["at"] >= a) & (joined["at"] < a + STEP_S)
        took = (trained >= a) & (trained < a + STEP_S)
        seen = np.flatnonzero((t >= a - 1) & (t < a + STEP_S))
        rows.append({
            "from_s": round(float(a - clear), 1),
            "events_read": int(events[seen].max() - events[seen].min()) if len(seen) > 1 else None,
            "produced": int(made.sum()),
            "produced_label": _mean(joined["labels"][made]),
            "produced_pre_trip": int((made & pre).sum()),
            "pre_trip_label": _mean(joined["labels"][made & pre]),
            "trained": int(took.sum()),
            "trained_label": _mean(joined["labels"][took]),
            "served_mean": _mean(served[look]),
        })  # fmt: skip
    return rows


def _mean(x: np.ndarray) -> float | None:
    x = x[np.isfinite(x)]
    return round(float(x.mean()), 4) if len(x) else None
