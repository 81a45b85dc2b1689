"""Every delta a streaming trainer published, in every version, read as it lands (``Published``):
retention deletes old versions while a long run goes on, so reading them at the end would miss
them. A delta is named by ``code(version, seq)``, one integer in publish order across versions."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

import model_store as ms
from model_store.deltas import DeltaManifest, read_delta

SEQ_BITS = 32


def code(version: NDArray[np.int64] | int, seq: NDArray[np.int64] | int) -> NDArray[np.int64]:
    """(version, delta seq) as one integer that orders them: every delta of a version before any of
    the next, and a version's seq -1 (none applied yet) after every delta of the versions before it
    (a full version holds what they trained)."""
    return (np.asarray(version, np.int64) << SEQ_BITS) + np.asarray(seq, np.int64)


@dataclass(frozen=True)
class Delta:
    version: int
    seq: int
    record: DeltaManifest


class Published(threading.Thread):
    """Reads the record of every new complete delta of ``model_dir``'s versions, in (version, seq)
    order, each ``poll_s`` until ``stop``."""

    def __init__(self, model_dir: Path, poll_s: float = 0.25) -> None:
        super().__init__(name="published", daemon=True)
        self.root, self.model, self.poll_s = model_dir.parent, model_dir.name, poll_s
        self.deltas: list[Delta] = []
        self.missed = 0
        """Deltas gone (retention) or unreadable before they were read."""
        self._seen: dict[int, set[int]] = {}  # version -> its deltas' seqs read (or missed)
        self._halt = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self._halt.wait(self.poll_s):
                self.harvest()
            self.harvest()
        except BaseException as e:  # raised by stop()
            self.error = e

    def stop(self) -> None:
        self._halt.set()
        self.join(60)
        if self.error is not None:
            raise self.error

    def harvest(self) -> None:
        for version in ms.versions(self.root, self.model):
            vdir = ms.version_dir(self.root, self.model, version)
            seen = self._seen.setdefault(int(version), set())
            for seq in ms.list_deltas(vdir, known=seen):
                seen.add(seq)
                try:
                    record = read_delta(ms.delta_dir(vdir, seq))
                except (OSError, ms.RecordError):
                    self.missed += 1
                    continue
                if record is not None:
                    self.deltas.append(Delta(int(version), seq, record))

    def records(self) -> list[DeltaManifest]:
        return [d.record for d in self.deltas]

    def codes(self) -> NDArray[np.int64]:
        return code(
            np.array([d.version for d in self.deltas], np.int64), np.array([d.seq for d in self.deltas])
        )

    def positions(self, topic: str = "samples") -> list[int]:
        """Per partition of ``topic``, where the newest delta's trainer resumes (0: no delta yet)."""
        from loadtest.stream_topics import TOPICS

        at = self.deltas[-1].record.positions if self.deltas else {}
        return [at.get(f"{topic}/{p}", 0) for p in range(TOPICS[topic])]

    def offsets(self) -> int:
        """The samples the newest delta's trainer had consumed (its offsets, summed; 0: none yet)."""
        return sum(self.deltas[-1].record.positions.values()) if self.deltas else 0
