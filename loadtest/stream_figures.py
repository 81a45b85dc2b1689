"""The figures of ``make bench-stream`` from the facts a run leaves: the samples topic as read (each
sample's partition, offset, key and label), the deltas' records (``DELTA.json``: each delta's
offsets, samples, progressive AUC; the last one's trained keys), the responses (the delta that
scored each) and the clicks' produce times (collected by ``Clicks`` as the users send them;
``expected_keys``: the samples due). Plain functions over numpy arrays, no Kafka.

Nothing here reads the trainer's trained-key files, so the counts hold whatever its dedupe window.
Which delta trained a sample: a delta records, per partition, the offset its trainer resumes at, so
the sample at (partition, offset) is in the first published delta whose offset there is past it
(a trainer killed between two deltas resumes at the last one's offsets: the mapping holds across
restarts). Of the samples of one key (a joiner restarted emits some again) the first so placed is
the one trained; the trainer drops the others by key.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from loadtest.paced import Responses
from model_store.deltas import DeltaManifest
from stream.records import Event
from training.evaluate import auc_logloss


@dataclass(frozen=True)
class SampleLog:
    """The samples topic as read, one row per record."""

    partition: NDArray[np.int64]
    offset: NDArray[np.int64]
    keys: NDArray[np.bytes_]
    """(item, request) as the trainer keys it: the item as 4 big-endian bytes, then the request id."""
    labels: NDArray[np.float32]
    produced: NDArray[np.float64] | None = None
    """When the joiner produced each record (its Kafka timestamp, seconds; None: not read)."""

    @classmethod
    def cat(cls, parts: list[SampleLog]) -> SampleLog:
        if not parts:
            return cls(
                np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, "S1"), np.zeros(0, np.float32)
            )
        times = [p.produced for p in parts if p.produced is not None]
        cols = [
            np.concatenate([getattr(p, f) for p in parts]) for f in ("partition", "offset", "keys", "labels")
        ]
        return cls(
            cols[0], cols[1], cols[2], cols[3], np.concatenate(times) if len(times) == len(parts) else None
        )


def keys_of(request_ids: NDArray[np.bytes_], items: NDArray[np.int64]) -> NDArray[np.bytes_]:
    """The key of each (request id, item) pair, as the trainer writes it."""
    width = request_ids.dtype.itemsize
    rid = np.frombuffer(np.ascontiguousarray(request_ids).tobytes(), np.uint8).reshape(
        len(request_ids), width
    )
    item = np.ascontiguousarray(items, dtype=">u4").view(np.uint8).reshape(len(items), 4)
    return np.ascontiguousarray(np.hstack([item, rid])).view(f"S{4 + width}").ravel()


def missing(wanted: NDArray[np.bytes_], have: NDArray[np.bytes_]) -> int:
    """How many of the keys ``wanted`` are not among ``have``."""
    width = max(wanted.dtype.itemsize, have.dtype.itemsize)
    return int((~np.isin(wanted.astype(f"S{width}"), have.astype(f"S{width}"))).sum())


def item_of(keys: NDArray[np.bytes_]) -> NDArray[np.int64]:
    """The item index of each key (its first 4 bytes, big-endian)."""
    raw = np.frombuffer(np.ascontiguousarray(keys).tobytes(), np.uint8).reshape(
        len(keys), keys.dtype.itemsize
    )
    return np.ascontiguousarray(raw[:, :4]).view(">u4").ravel().astype(np.int64)


def delta_index(log: SampleLog, records: list[DeltaManifest], topic: str) -> NDArray[np.int64]:
    """Per sample, the index (in ``records``, published order) of the delta that consumed it; -1
    when no published delta did."""
    out = np.full(len(log.offset), -1, np.int64)
    for p in np.unique(log.partition).tolist():
        at = np.array([r.positions.get(f"{topic}/{p}", 0) for r in records], np.int64)
        mine = np.flatnonzero(log.partition == p)
        k = np.searchsorted(np.maximum.accumulate(at), log.offset[mine], side="right") if len(at) else 0
        out[mine] = np.where(k < len(records), k, -1)
    return out


def first_trained(log: SampleLog, delta: NDArray[np.int64]) -> NDArray[np.bool_]:
    """Per sample: the first consumed sample of its key (the one trained; later ones are dropped)."""
    placed = np.flatnonzero(delta >= 0)
    order = placed[np.lexsort((log.offset[placed], delta[placed]))]
    _, first = np.unique(log.keys[order], return_index=True)
    out = np.zeros(len(delta), bool)
    out[order[first]] = True
    return out


@dataclass(frozen=True)
class Counted:
    """Samples trained twice and never trained, counted against the impression log."""

    duplicates: int
    """Over the deltas: samples a delta's record says it trained beyond the new keys its offsets
    hold (a key trained before trained again)."""
    lost: int
    """Expected keys no published delta's offsets hold, plus new keys a delta's offsets hold beyond
    what its record says it trained (skipped)."""


def exactly_once(log: SampleLog, delta: NDArray[np.int64], first: NDArray[np.bool_], records: list[DeltaManifest],
                 expected: NDArray[np.bytes_]) -> Counted:  # fmt: skip
    """Each delta's record against the new keys its offsets hold, and ``expected`` (every sample
    the impression log calls for) against the keys the published deltas hold."""
    placed = np.bincount(delta[first], minlength=len(records))[: len(records)]
    said = np.array([r.samples for r in records], np.int64)
    return Counted(int(np.maximum(0, said - placed).sum()),
                   missing(expected, log.keys[first]) + int(np.maximum(0, placed - said).sum()))  # fmt: skip


@dataclass(frozen=True)
class AucPair:
    streaming: float | None
    frozen: float | None
    windows: int
    """Deltas compared (those whose samples hold both labels)."""
    samples_differ: int
    """Deltas whose record's sample count differs from the samples placed in them here (0: both
    AUCs are over the same samples)."""


def progressive_auc(log: SampleLog, delta: NDArray[np.int64], first: NDArray[np.bool_],
                    records: list[DeltaManifest], frozen_scores: NDArray[np.float32]) -> AucPair:  # fmt: skip
    """The streaming model's progressive AUC (each delta's record: its samples scored before they
    trained) and the frozen model's on exactly those samples, delta by delta (the frozen model, the
    version served at the start, scores item i ``frozen_scores[i]``: every request holds the same
    items), both weighted by the deltas' samples."""
    trained = np.flatnonzero(first)
    trained = trained[np.argsort(delta[trained], kind="stable")]
    bounds = np.searchsorted(delta[trained], np.arange(len(records) + 1))
    items = item_of(log.keys)
    pairs, differ = [], 0
    for k, r in enumerate(records):
        rows = trained[bounds[k] : bounds[k + 1]]
        differ += int(len(rows) != r.samples)
        if r.auc is None or not r.samples:
            continue
        frozen, _ = auc_logloss(log.labels[rows], frozen_scores[items[rows]])
        if not np.isnan(frozen):
            pairs.append((r.auc, frozen, r.samples))
    if not pairs:
        return AucPair(None, None, 0, differ)
    a = np.array(pairs)
    w = a[:, 2]
    return AucPair(round(float(np.average(a[:, 0], weights=w)), 4), round(float(np.average(a[:, 1], weights=w)), 4),
                   len(pairs), differ)  # fmt: skip


def percentiles_s(x: NDArray[np.float64]) -> dict:
    if not len(x):
        return {"p50": None, "p99": None, "n": 0}
    return {
        "p50": round(float(np.percentile(x, 50)), 3),
        "p99": round(float(np.percentile(x, 99)), 3),
        "n": len(x),
    }


def click_rows(clicks: tuple[NDArray[np.bytes_], NDArray[np.float64]], log: SampleLog,
               first: NDArray[np.bool_]) -> tuple[NDArray[np.bool_], NDArray[np.int64]]:  # fmt: skip
    """For each click (its sample's key, its produce time): whether its positive sample was trained
    (``first``: the log's rows trained first), and for those the sample's row in ``log``."""
    keys, _ = clicks
    pos = np.flatnonzero(first & (log.labels > 0))
    width = max(keys.dtype.itemsize, log.keys.dtype.itemsize)
    pk = log.keys[pos].astype(f"S{width}")
    order = np.argsort(pk)
    probe = keys.astype(f"S{width}")
    at = np.searchsorted(pk[order], probe).clip(max=max(len(pos) - 1, 0))
    hit = (pk[order][at] == probe) if len(pos) else np.zeros(len(keys), bool)
    return hit, pos[order[at[hit]]]


def event_to_served(clicks: tuple[NDArray[np.bytes_], NDArray[np.float64]], log: SampleLog,
                    delta: NDArray[np.int64], first: NDArray[np.bool_], seqs: NDArray[np.int64],
                    responses: Responses) -> tuple[NDArray[np.float64], NDArray[np.float64], int]:  # fmt: skip
    """For each click (its sample's key, the wall time it was produced) whose positive sample was
    trained into a delta: seconds from its produce time to the first response scored with that
    delta or a later one (deltas apply in seq order, so a later one holds it too). Returns (produce
    times, seconds) of the clicks served so, and how many of the trained ones no response served
    (the load had stopped)."""
    hit, rows = click_rows(clicks, log, first)
    seq = seqs[delta[rows]]
    t_click = clicks[1][hit]
    ok = responses.status == 200
    done, served_seq = responses.done[ok], np.maximum.accumulate(responses.delta_seq[ok])
    j = np.searchsorted(served_seq, seq, side="left")
    served = j < len(done)
    t_served = done[j[served]]
    return t_click[served], np.maximum(0.0, t_served - t_click[served]), int((~served).sum())


def event_to_written(clicks: tuple[NDArray[np.bytes_], NDArray[np.float64]], log: SampleLog,
                     delta: NDArray[np.int64], first: NDArray[np.bool_],
                     written: NDArray[np.float64]) -> dict[str, NDArray[np.float64]]:  # fmt: skip
    """The first parts of ``event_to_served``, for each click trained into a delta: ``click`` its
    produce time; ``joined`` seconds to its sample's produce time (the joiner; empty where the log
    has no produce times); ``written`` seconds to its delta's record (``written[delta]``: the
    joiner, the trainer's read and step, the wait for the cut). The rest is the delta reaching
    serving and a response."""
    hit, rows = click_rows(clicks, log, first)
    t_click = clicks[1][hit]
    joined = log.produced[rows] - t_click if log.produced is not None else np.zeros(0)
    return {"click": t_click, "joined": joined, "written": written[delta[rows]] - t_click}


def expected_keys(imps: list[tuple[str, float, int, int]], window_s: float) -> np.ndarray:
    """The sample keys of every impression whose window closed before the last impression."""
    last_ts = max(i[1] for i in imps)
    closed = [i for i in imps if i[1] + window_s < last_ts]
    if not closed:
        return np.zeros(0, "S1")
    rid = np.repeat(np.array([i[0].encode() for i in closed]), [i[2] for i in closed])
    return keys_of(rid, np.concatenate([np.arange(i[2]) for i in closed]))


class Clicks:
    """The clicks the users sent and when each was handed to the producer (``play``'s ``on_sent``)."""

    def __init__(self) -> None:
        self.parts: list[tuple[list[Event], float]] = []

    def __call__(self, events: list[Event], t: float) -> None:
        self.parts.append((events, t))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(sample keys, produce times)."""
        events = [e for es, _ in self.parts for e in es]
        t = np.array([t for es, t in self.parts for _ in es], np.float64)
        rid = np.array([e.request_id.encode() for e in events]) if events else np.zeros(0, "S1")
        return keys_of(rid, np.array([e.item for e in events], np.int64)), t
