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

A kill's cost in time: ``recovery_s`` and ``back_under_s`` (from the trainer's lag sampled every second) and
``outside_kills`` (the clicks away from the kills, whose wait is the loop's steady one).
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
    """The clicks the users sent and when each was handed to the producer (``play``'s ``on_sent``),
    kept as arrays per batch: a bench of half an hour sends 2 million clicks, and keeping each
    ``Event`` left millions of objects for the bench's garbage collector to scan, a pause of up to
    a second every minute or so in the process that records the responses (bench-soak: clicks that
    took over 2 s in moments 50-85 s apart, longer as the run went on)."""

    def __init__(self) -> None:
        self.parts: list[tuple[NDArray[np.bytes_], NDArray[np.int64], float]] = []

    def __call__(self, events: list[Event], t: float) -> None:
        if events:
            rid = np.array([e.request_id.encode() for e in events])
            self.parts.append((rid, np.array([e.item for e in events], np.int64), t))

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(sample keys, produce times)."""
        if not self.parts:
            return keys_of(np.zeros(0, "S1"), np.zeros(0, np.int64)), np.zeros(0, np.float64)
        t = np.repeat(np.array([t for _, _, t in self.parts], np.float64), [len(i) for _, i, _ in self.parts])
        rid = np.concatenate([r for r, _, _ in self.parts])
        return keys_of(rid, np.concatenate([i for _, i, _ in self.parts])), t


def owed_by_the_joiner(imps: list[tuple[str, float, int, int]], window_s: float, log: SampleLog,
                       t: NDArray[np.float64]) -> NDArray[np.int64]:  # fmt: skip
    """At each time in ``t``: the samples the joiner owed then, those of an impression (``imps``:
    request id, ts, items, ...) whose window had closed (its ts + ``window_s``) of which no sample
    had been produced yet (``log.produced``: a sample never produced is owed to the end). A
    killed joiner's backlog, and the windows a restarted one reads again, show here: the
    trainer's lag (the samples topic's end) does not see what was never written."""
    t = np.asarray(t, np.float64)
    if not imps or log.produced is None:
        return np.zeros(len(t), np.int64)
    items = np.array([i[2] for i in imps], np.int64)
    keys = keys_of(np.repeat(np.array([i[0].encode() for i in imps]), items),
                   np.concatenate([np.arange(n) for n in items]))  # fmt: skip
    due = np.repeat(np.array([i[1] for i in imps], np.float64) + window_s, items)
    width = f"S{max(keys.dtype.itemsize, log.keys.dtype.itemsize)}"
    order = np.lexsort((log.produced, log.keys.astype(width)))  # by key, each key's first produce first
    have, first = np.unique(log.keys[order].astype(width), return_index=True)
    produced = np.full(len(keys), np.inf)
    if len(have):
        at = np.searchsorted(have, keys.astype(width)).clip(max=len(have) - 1)
        hit = have[at] == keys.astype(width)
        produced[hit] = log.produced[order][first][at[hit]]
    end = np.sort(np.maximum(due, produced))
    return np.searchsorted(np.sort(due), t, side="right") - np.searchsorted(end, t, side="right")


RECOVERY_TARGET_S = 30.0
"""Issue 57: a killed role's loop is back under one second of traffic behind within this long."""


def recovery_s(t: NDArray[np.float64], lag: NDArray[np.int64], kill: float, until: float,
               under: float) -> float | None:  # fmt: skip
    """Seconds from ``kill`` until the loop's lag is back under ``under`` samples (one second of
    traffic) and stays there, from the lag sampled at times ``t``: the samples the trainer's
    published offsets (its last delta's) are behind the samples topic's end, plus those the joiner
    owes (``owed_by_the_joiner``: while a killed joiner is down the topic's end stands still, and
    the trainer's lag alone reads 0). Of the samples in (``kill``, ``until``) -- ``until``: the
    next kill or the load's end -- the first one under ``under`` after the last one at or above
    it, its time less ``kill``; 0.0 when none there was at or above it (never a second of traffic
    behind, to the sampling's resolution); None when the last one there is still at or above it
    (not recovered before ``until``) or there are none."""
    return _after_kill(t, lag, kill, until, under, lambda over: over[-1] + 1)


def _after_kill(t: NDArray[np.float64], lag: NDArray[np.int64], kill: float, until: float, under: float,
                back: Callable[[NDArray[np.int64]], int | None]) -> float | None:  # fmt: skip
    """The looks in (``kill``, ``until``): None when there are none, 0.0 when none is at or above
    ``under``, else the time less ``kill`` of the look ``back(over)`` picks (``over``: the indexes
    of the looks at or above it; None or past the last look: not back under)."""
    t, lag = np.asarray(t, np.float64), np.asarray(lag, np.float64)
    m = (t > kill) & (t < until)
    t, lag = t[m], lag[m]
    if not len(t):
        return None
    over = np.flatnonzero(lag >= under)
    if not len(over):
        return 0.0
    i = back(over)
    return None if i is None or i >= len(t) else round(float(t[i] - kill), 1)


def back_under_s(t: NDArray[np.float64], lag: NDArray[np.int64], kill: float, until: float,
                 under: float) -> float | None:  # fmt: skip
    """Seconds from ``kill`` until the lag (as ``recovery_s`` reads it) first falls back under
    ``under`` after its first look at or above it: the kill's own setback, which ``recovery_s``
    extends to the last look over the line before ``until`` (the steady state's noise included).
    0.0 when no look there was at or above it; None when it never fell back under (or no look)."""

    def first_under(over: NDArray[np.int64]) -> int | None:
        # the first look under the line after the first over it: a gap in the indexes over it
        gaps = np.flatnonzero(np.diff(over) > 1)
        return int(over[gaps[0]] + 1) if len(gaps) else int(over[-1] + 1)

    return _after_kill(t, lag, kill, until, under, first_under)


def outside_kills(t: NDArray[np.float64], kills: list[float], before_s: float,
                  after_s: float = RECOVERY_TARGET_S) -> NDArray[np.bool_]:  # fmt: skip
    """Per time in ``t``: outside every kill's window, [kill - ``before_s``, kill + ``after_s``)
    (``after_s``: the recovery allowed, whatever the recovery measured)."""
    out = np.ones(len(t), bool)
    for k in kills:
        out &= (t < k - before_s) | (t >= k + after_s)
    return out


PHASES = ("before_kills", "after_trainer_kill", "after_joiner_kill")


def served_figures(t_click: NDArray[np.float64], seconds: NDArray[np.float64], start: float, end: float,
                   kills: dict[str, float], before_s: float) -> dict:  # fmt: skip
    """bench-stream's event -> served figures from ``event_to_served``'s (produce times, seconds),
    over the clicks produced from ``start`` (the load's) to 5 s before ``end`` (a click in the
    load's last seconds had no response left to see it): ``event_to_served_s`` those outside the
    kills' windows (``outside_kills``: ``before_s`` before a kill to ``RECOVERY_TARGET_S`` after),
    ``..._all`` every one, ``..._by_phase`` those from ``start``, from ``before_s`` before the
    trainer's kill and from ``before_s`` before the joiner's (``kills``: role -> wall time)."""
    measured = (t_click >= start) & (t_click < end - 5.0)
    steady = measured & outside_kills(t_click, list(kills.values()), before_s)
    cuts = [start, *(kills.get(n, end + before_s) - before_s for n in ("trainer", "joiner")), end]
    by_phase = [
        percentiles_s(seconds[measured & (t_click >= a) & (t_click < z)])
        for a, z in zip(cuts, cuts[1:], strict=False)
    ]
    over = f"clicks of the load outside [kill - {before_s:g} s, kill + {RECOVERY_TARGET_S:g} s) of every kill"
    return {"event_to_served_s": {**percentiles_s(seconds[steady]), "over": over},
            "event_to_served_s_all": percentiles_s(seconds[measured]),
            "event_to_served_s_by_phase": dict(zip(PHASES, by_phase, strict=True))}  # fmt: skip


def targets(out: dict, log_ratio: float) -> dict[str, bool]:
    """bench-stream's targets (issue 57's among them) from its figures, met or not; a figure that
    could not be measured (None) misses its target."""
    auc, e2s_p99 = out["progressive_auc"], out["event_to_served_s"]["p99"]
    ok = {"no_duplicates": out["duplicate_samples"] == 0, "no_lost": out["lost_samples"] == 0,
          "event_to_served_p99_outside_the_kills_le_2s": e2s_p99 is not None and e2s_p99 <= 2.0}  # fmt: skip
    for role, s in out["recovery_s"].items():
        ok[f"{role}_recovery_s_le_{RECOVERY_TARGET_S:g}"] = s is not None and s <= RECOVERY_TARGET_S
    ok[f"logging_p99_ratio_le_{log_ratio}"] = (out["logging_p99_ratio"] or math.inf) <= log_ratio
    if auc["streaming"] is not None and auc["frozen"] is not None:
        ok["streaming_auc_ge_frozen_plus_0.02"] = auc["streaming"] >= auc["frozen"] + 0.02
    return ok


def busy_pct(busy: list[tuple[float, float]], a: float, b: float) -> float | None:
    """The machine's CPU use from ``a`` to ``b`` in % of one CPU, from (time, busy CPU seconds so
    far) looks; None with fewer than two looks there."""
    got = [(t, s) for t, s in busy if a <= t <= b]
    if len(got) < 2 or got[-1][0] <= got[0][0]:
        return None
    return round(100 * (got[-1][1] - got[0][1]) / (got[-1][0] - got[0][0]), 1)


def cpu_figures(per_process: Callable[[float, float], dict[str, float]], busy: list[tuple[float, float]],
                windows: dict[str, tuple[float, float]]) -> dict:  # fmt: skip
    """Per window (name -> (from, to)): each process's CPU (``per_process``, e.g.
    ``loadtest.series.Series.cpu_pct``), the whole ``machine``'s and ``others``' (the machine's
    less those processes': anything else running), all in % of one CPU."""
    out = {}
    for name, (a, b) in windows.items():
        ours, machine = per_process(a, b), busy_pct(busy, a, b)
        others = None if machine is None else round(machine - sum(ours.values()), 1)
        out[name] = {**ours, "machine": machine, "others": others}
    return out
