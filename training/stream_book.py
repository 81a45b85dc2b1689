"""What a continuous trainer keeps beside its tables between two deltas, and writes into each
(``model_store.deltas``): the keys trained (``--stream``: a sample whose key is there is dropped),
progressive validation (each batch scored before it trains), the counts of samples trained,
dropped as duplicates and refused as malformed, and (``--metrics-port``) their Prometheus metrics:

``recserve_follow_samples_total``, ``recserve_follow_duplicates_total``,
``recserve_follow_refused_total`` (sent to the dead-letter topic), ``recserve_follow_deltas_total``,
``recserve_follow_progressive_auc`` and ``recserve_follow_progressive_logloss`` (the last delta's
window), ``recserve_follow_offset`` (per unit: the next offset or row the last delta recorded).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from model_store.deltas import DeltaManifest, last_record, read_keys, write_delta
from training.progressive import Progressive, Score
from training.sources import Chunk
from training.sources.ledger import Ledger
from training.trained_keys import TrainedKeys

log = logging.getLogger("recserve.train.follow")


@dataclass
class Counts:
    rows: int = 0
    duplicates: int = 0
    refused: int = 0


class _Metrics:
    def __init__(self, port: int, host: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        from serving.rpc.metrics import start_metrics_server

        reg = self.registry = CollectorRegistry()
        self.samples = Counter("recserve_follow_samples", "Samples trained.", registry=reg)
        self.duplicates = Counter("recserve_follow_duplicates", "Samples dropped: key trained already.",
                                  registry=reg)  # fmt: skip
        self.refused = Counter("recserve_follow_refused", "Malformed samples (to the dead-letter topic).",
                               registry=reg)  # fmt: skip
        self.deltas = Counter("recserve_follow_deltas", "Deltas cut.", registry=reg)
        self.auc = Gauge("recserve_follow_progressive_auc", "Progressive AUC of the last delta's samples.",
                         registry=reg)  # fmt: skip
        self.logloss = Gauge("recserve_follow_progressive_logloss",
                             "Progressive log loss of the last delta's samples.", registry=reg)  # fmt: skip
        self.offset = Gauge("recserve_follow_offset", "Where each unit resumes, as the last delta recorded.",
                            ["unit"], registry=reg)  # fmt: skip
        self.close = start_metrics_server(port, host, reg)


@dataclass
class StreamBook:
    source: str
    """The spec followed (``DeltaManifest.source``)."""
    keyed: bool
    """A stream of keyed samples (keys kept and saved)."""
    window_s: float
    keys: TrainedKeys = field(init=False)
    progressive: Progressive = field(default_factory=Progressive)
    total: Counts = field(default_factory=Counts)
    windows: list[Score] = field(default_factory=list)
    """Progressive scores per delta."""
    _cut: Counts = field(default_factory=Counts)  # totals at the last delta
    _metrics: _Metrics | None = None

    def __post_init__(self) -> None:
        self.keys = TrainedKeys(self.window_s)

    def serve_metrics(self, port: int, host: str) -> None:
        self._metrics = _Metrics(port, host)

    @property
    def registry(self):
        """The /metrics registry (None: no --metrics-port), for the trainer's other counters."""
        return None if self._metrics is None else self._metrics.registry

    def admit(self, chunk: Chunk) -> NDArray[np.int64] | None:
        """Rows of a keyed chunk to train: those whose key was not trained (None: all of them);
        the others and the chunk's refused records are counted."""
        assert chunk.keyed is not None
        new = self.keys.new(chunk.keyed.keys)
        dups = int((~new).sum())
        self.total.duplicates += dups
        self.total.refused += chunk.refused
        if self._metrics is not None:
            self._metrics.duplicates.inc(dups)
            self._metrics.refused.inc(chunk.refused)
        return None if not dups else np.flatnonzero(new)

    def trained(self, chunk: Chunk, rows: NDArray[np.int64] | None, labels: NDArray[np.float32],
                scores: NDArray[np.float32]) -> None:  # fmt: skip
        """``rows`` of ``chunk`` (None: all) trained, scored ``scores`` before they were."""
        assert chunk.keyed is not None
        keys, ts = chunk.keyed.keys, chunk.keyed.ts
        self.keys.add(keys if rows is None else keys[rows], ts if rows is None else ts[rows])
        self.rows(len(labels))
        self.progressive.add(labels, scores)

    def rows(self, n: int) -> None:
        self.total.rows += n
        if self._metrics is not None:
            self._metrics.samples.inc(n)

    def write(self, ddir: Path, positions: dict[str, int]) -> None:
        """Write the delta's record (positions, counts and scores since the last, keys)."""
        score = self.progressive.close_window()
        t, c = self.total, self._cut
        record = DeltaManifest(self.source, positions, t.rows - c.rows, t.duplicates - c.duplicates,
                               score.auc, score.logloss)  # fmt: skip
        write_delta(ddir, record, self.keys.arrays() if self.keyed else None)
        self._cut = Counts(t.rows, t.duplicates, t.refused)
        if score.samples:
            self.windows.append(score)
        if self._metrics is not None:
            self._metrics.deltas.inc()
            for unit, at in positions.items():
                self._metrics.offset.labels(unit).set(at)
            if score.samples:
                self._metrics.auc.set(float("nan") if score.auc is None else score.auc)
                self._metrics.logloss.set(score.logloss or 0.0)

    def resume(self, vdir: Path, ledger: Ledger) -> None:
        """A stream resumes where the version's last delta says (offsets and keys trained), over
        the ledger file, which a crash between a delta's _SUCCESS and its commit left behind."""
        last = last_record(vdir) if self.keyed else None
        if last is not None and last[0].source == self.source:
            ledger.resume(last[0].positions)
            self.keys = TrainedKeys(self.window_s, *read_keys(last[1], last[0]))
            log.info("resuming at %s, %d keys trained (%s)", last[0].positions, len(self.keys), last[1])

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
