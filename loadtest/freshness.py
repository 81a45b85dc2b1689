"""What a streaming trainer published, harvested as it lands, and how soon a click was served.

``TrainedLog`` polls a model's store for every complete delta of every version, in (version, seq)
order, while the run goes on (retention deletes old versions, so reading at the end would miss
them): each delta's record (samples trained, offsets) and the keys it trained first -- its trained
keys (the trainer's dedupe window) less those of the delta read before it, keys as integers
(``loadtest.recorder.key_ints``). A key trained twice (a duplicate the dedupe missed) is then
counted twice in the samples while it is one distinct key.

``event_to_served``: from a click event's produce time to the end of the first response, from
any endpoint, scored with a delta that holds its sample (a response holds the deltas up to its
version and its lowest shard delta seq, and every delta of an older version: a full version cut by
the trainer holds all it trained).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

import model_store as ms
from loadtest.recorder import Responses, key_ints
from model_store.deltas import read_delta, read_keys

SEQ_BITS = 32


def code(version: NDArray[np.int64] | int, seq: NDArray[np.int64] | int) -> NDArray[np.int64]:
    """(version, delta seq) as one integer that orders them; a version's seq -1 (no delta) sorts
    after every delta of the versions before it."""
    return (np.asarray(version, np.int64) << SEQ_BITS) + np.asarray(seq, np.int64)


@dataclass(frozen=True)
class Delta:
    version: int
    seq: int
    samples: int
    offsets: int
    """The sum of the offsets it resumes at (all partitions)."""
    seen: float
    """time.time() when this harvest read it."""


class TrainedLog(threading.Thread):
    """Reads every new complete delta of ``model_dir``'s versions each ``poll_s`` until stopped."""

    def __init__(self, model_dir: Path, poll_s: float = 0.25) -> None:
        super().__init__(name="trained-log", daemon=True)
        self.root, self.model, self.poll_s = model_dir.parent, model_dir.name, poll_s
        self.deltas: list[Delta] = []
        self.missed = 0
        """Deltas gone (retention) or unreadable before they were read."""
        self._new: list[NDArray[np.int64]] = []  # per delta, the keys it trained first
        self._prev = np.zeros(0, np.int64)
        self._done: set[tuple[int, int]] = set()
        self._halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                self.harvest()
                self._halt.wait(self.poll_s)
            self.harvest()
        except BaseException as e:  # reported by stop()
            self.error = e

    def stop(self) -> None:
        self._halt.set()
        self.join(120)
        if self.error is not None:
            raise self.error

    def harvest(self) -> None:
        import time

        for version in ms.versions(self.root, self.model):
            vdir = ms.version_dir(self.root, self.model, version)
            for seq in ms.list_deltas(vdir):
                if (int(version), seq) in self._done:
                    continue
                self._done.add((int(version), seq))
                d = ms.delta_dir(vdir, seq)
                try:
                    record = read_delta(d)
                    keys = key_ints(read_keys(d, record)[0]) if record is not None else None
                except (OSError, ms.CorruptVersion, ms.RecordError):
                    self.missed += 1
                    continue
                if record is None or keys is None:
                    continue
                at = np.searchsorted(self._prev, keys).clip(max=max(len(self._prev) - 1, 0))
                seen = (self._prev[at] == keys) if len(self._prev) else np.zeros(len(keys), bool)
                self._new.append(keys[~seen])
                self._prev = keys
                self.deltas.append(Delta(int(version), seq, record.samples, sum(record.positions.values()),
                                         time.time()))  # fmt: skip

    def trained(self) -> tuple[NDArray[np.int64], NDArray[np.int32]]:
        """(every key trained, sorted; the index in ``deltas`` of the first delta that trained it)."""
        chunks = list(self._new)  # the harvest appends meanwhile
        if not chunks:
            return np.zeros(0, np.int64), np.zeros(0, np.int32)
        keys = np.concatenate(chunks)
        first = np.repeat(np.arange(len(chunks), dtype=np.int32), [len(k) for k in chunks])
        order = np.argsort(keys, kind="stable")  # a key's first delta first
        keys, first = keys[order], first[order]
        once = np.ones(len(keys), bool)
        once[1:] = keys[1:] != keys[:-1]
        return keys[once], first[once]

    def samples(self) -> int:
        return sum(d.samples for d in self.deltas)

    def offsets(self) -> int:
        """The newest delta's offsets (0: none yet)."""
        return self.deltas[-1].offsets if self.deltas else 0


def first_served(deltas: list[Delta], responses: Responses) -> NDArray[np.float64]:
    """Per delta, when the first response that holds it ended (inf: none did)."""
    if not deltas or not len(responses.end):
        return np.full(len(deltas), np.inf)
    codes = code(np.array([d.version for d in deltas]), np.array([d.seq for d in deltas]))
    order = np.argsort(responses.end, kind="stable")
    ok = responses.version[order] >= 0
    held = np.searchsorted(np.sort(codes), code(responses.version[order], responses.seq[order]), "right") - 1
    held = np.maximum.accumulate(np.where(ok, held, -1))  # the most any response so far held
    rank = np.searchsorted(np.sort(codes), codes)  # each delta's place in (version, seq) order
    at = np.searchsorted(held, rank, "left")
    end = np.append(responses.end[order], np.inf)
    return end[at]


def event_to_served(clicks: NDArray[np.int64], produced: NDArray[np.float64], log: TrainedLog,
                    responses: Responses) -> NDArray[np.float64]:  # fmt: skip
    """Per click (its sample's key, its event's produce time): seconds to the first response
    holding its sample (nan: its sample was not trained, or not served, by the end)."""
    keys, first = log.trained()
    served = np.append(first_served(log.deltas, responses), np.inf)
    at = np.searchsorted(keys, clicks).clip(max=max(len(keys) - 1, 0))
    found = keys[at] == clicks if len(keys) else np.zeros(len(clicks), bool)
    when = served[np.where(found, first[at] if len(keys) else -1, -1)]
    out = when - produced
    out[~np.isfinite(out)] = np.nan
    return out


def percentiles_s(seconds: NDArray[np.float64]) -> dict:
    """{p50, p99} in seconds of the finite ones (None each when there are none)."""
    s = seconds[np.isfinite(seconds)]
    if not len(s):
        return {"p50": None, "p99": None}
    return {"p50": round(float(np.percentile(s, 50)), 3), "p99": round(float(np.percentile(s, 99)), 3)}
