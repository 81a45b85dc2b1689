"""What a continuous trainer keeps beside its tables between two deltas, and writes into each
(``model_store.deltas``): the keys trained (``--stream``: a sample whose key is there is dropped),
progressive validation (each batch scored before it trains), the counts of samples trained,
dropped as duplicates and refused as malformed, and (``--metrics-port``) their Prometheus metrics:

``recserve_follow_samples_total``, ``recserve_follow_duplicates_total``,
``recserve_follow_refused_total`` (sent to the dead-letter topic), ``recserve_follow_deltas_total``,
``recserve_follow_delta_cut_seconds`` (a histogram: how long each delta's cut held training),
``recserve_follow_delta_publish_seconds`` (from a cut to its delta's ``_SUCCESS`` and announce),
``recserve_follow_progressive_auc`` and ``recserve_follow_progressive_logloss`` (the last delta's
window; a window of one label only has no AUC: the gauge keeps the last AUC and
``recserve_follow_progressive_one_class_total`` counts it), ``recserve_follow_offset`` (per unit: the next offset or row the last delta recorded),
``recserve_follow_lag_samples`` (the consumer lag: samples of the followed partitions after those
trained, at the trainer's last look; its maximum is the result's ``max_lag_samples``),
``recserve_follow_final_auc``, ``_final_logloss`` and ``_final_calibration`` (the whole run's
progressive figures against the final labels: ``training.follow.final_labels``).
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from model_store.deltas import DeltaManifest, last_record, read_keys, write_delta
from training.follow.final_labels import FinalLabels
from training.follow.progressive import WINDOWS_KEPT, Progressive
from training.follow.trained_keys import TrainedKeys
from training.follow.types import Counts, FollowResult, Score
from training.sources import Keyed
from training.sources.ledger import Ledger

log = logging.getLogger("recserve.train.follow")

WHOLE_MIN_KEYS = 65_536
"""A delta's key file holds only the keys trained since the last delta, until the files added
since the last whole-window file hold as many keys as it held (at least this many) or number
``WHOLE_EVERY``: then the whole window. Rewritten every delta, the window cost 68 MiB and 0.5-0.8 s
at 1.5M keys; by this rule a restart reads at most about twice the window, the disk holds as
much per chain, and the whole files cost about one added key's bytes per key added (amortised)."""
WHOLE_EVERY = 256
"""Files added at most between two whole-window ones (a slow stream: a restart reads a bounded
number of files)."""


CUT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""``recserve_follow_delta_cut_seconds``'s buckets: a cut holds the step, against a delta
interval of 0.5-1 s."""


class _Metrics:
    def __init__(self, port: int, host: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        from serving.rpc.metrics import start_metrics_server

        reg = self.registry = CollectorRegistry()
        self.samples = Counter("recserve_follow_samples", "Samples trained.", registry=reg)
        self.duplicates = Counter("recserve_follow_duplicates", "Samples dropped: key trained already.",
                                  registry=reg)  # fmt: skip
        self.refused = Counter("recserve_follow_refused", "Malformed samples (to the dead-letter topic).",
                               registry=reg)  # fmt: skip
        self.deltas = Counter("recserve_follow_deltas", "Deltas cut.", registry=reg)
        self.cut_seconds = Histogram("recserve_follow_delta_cut_seconds",
                                     "Seconds a delta's cut held training (flush, the rows and the record "
                                     "taken; with gRPC shards or a final cut, until it was published).",
                                     buckets=CUT_BUCKETS_S, registry=reg)  # fmt: skip
        self.publish_seconds = Histogram("recserve_follow_delta_publish_seconds",
                                         "Seconds from a delta's cut to its _SUCCESS and announce (its "
                                         "files written on the cut's own thread).", buckets=CUT_BUCKETS_S,
                                         registry=reg)  # fmt: skip
        self.auc = Gauge("recserve_follow_progressive_auc", "Progressive AUC of the last delta's samples.",
                         registry=reg)  # fmt: skip
        self.one_class = Counter("recserve_follow_progressive_one_class",
                                 "Deltas whose samples held one label only (no AUC: the AUC gauge "
                                 "keeps the last delta's that had one).", registry=reg)  # fmt: skip
        self.logloss = Gauge("recserve_follow_progressive_logloss",
                             "Progressive log loss of the last delta's samples.", registry=reg)  # fmt: skip
        self.offset = Gauge("recserve_follow_offset", "Where each unit resumes, as the last delta recorded.",
                            ["unit"], registry=reg)  # fmt: skip
        self.skipped = Counter("recserve_follow_skipped_records", "Records of the stream gone when read past "
                               "(the broker's retention passed them first), never trained.", registry=reg)  # fmt: skip
        self.lag = Gauge("recserve_follow_lag_samples",
                         "Samples of the followed partitions after those trained, at the last look.",
                         registry=reg)  # fmt: skip
        self.final = {k: Gauge(f"recserve_follow_final_{k}", f"Progressive {k} of the run against the final labels "
                               "(corrections applied to the first labels they correct).", registry=reg)
                      for k in ("auc", "logloss", "calibration")}  # fmt: skip
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
    windows: deque[Score] = field(default_factory=lambda: deque(maxlen=WINDOWS_KEPT))
    """Progressive scores per delta."""
    _cut: Counts = field(default_factory=Counts)  # totals at the last delta
    _since_cut: list[tuple[NDArray[np.bytes_], NDArray[np.float64]]] = field(default_factory=list)
    """Keys trained since the last delta, with their times (what a rank sends rank 0)."""
    _recorded: dict[str, int] = field(default_factory=dict)
    """The positions the last delta recorded (or the one resumed from)."""
    _keys_at: Path | None = None
    """The last record written or resumed from in the version followed (None: the next key file
    holds the whole window), with its ``keys_links`` and ``keys_added``."""
    _links: int = 0
    _added: int = 0
    _metrics: _Metrics | None = None

    def __post_init__(self) -> None:
        self.keys = TrainedKeys(self.window_s)
        self.final = FinalLabels(self.window_s)

    def serve_metrics(self, port: int, host: str) -> None:
        self._metrics = _Metrics(port, host)

    @property
    def registry(self):
        """The /metrics registry (None: no --metrics-port), for the trainer's other counters."""
        return None if self._metrics is None else self._metrics.registry

    def admit(self, keyed: Keyed, refused: int) -> NDArray[np.int64] | None:
        """Rows of keyed samples to train: those whose key was not trained (None: all of them);
        the others and the ``refused`` records beside them are counted."""
        new = self.keys.new(keyed.keys)
        dups = int((~new).sum())
        self.total.duplicates += dups
        self.total.refused += refused
        if self._metrics is not None:
            self._metrics.duplicates.inc(dups)
            self._metrics.refused.inc(refused)
        return None if not dups else np.flatnonzero(new)

    def trained(self, keyed: Keyed, rows: NDArray[np.int64] | None, labels: NDArray[np.float32],
                scores: NDArray[np.float32]) -> None:  # fmt: skip
        """``rows`` of ``keyed`` (None: all) trained, scored ``scores`` before they were."""
        keys, ts, kinds = keyed.keys, keyed.ts, keyed.kinds
        if rows is not None:
            keys, ts, kinds = keys[rows], ts[rows], kinds[rows]
        self.add_keys(keys, ts)
        self.rows(len(labels))
        self.progressive.add(labels, scores)
        self.final.add(keys, kinds, ts, labels, scores)

    def add_keys(self, keys: NDArray[np.bytes_], ts: NDArray[np.float64]) -> None:
        """Keys trained (here, or by another rank: ``training.follow.ranks``), for the next delta."""
        if len(keys):
            self.keys.add(keys, ts)
            self._since_cut.append((keys, ts))

    def lag(self, samples: int | None, skipped: int = 0) -> None:
        """The source's consumer lag now (None: unknown), and the records it read past, gone."""
        if self._metrics is not None and skipped > self.total.skipped:
            self._metrics.skipped.inc(skipped - self.total.skipped)
        self.total.skipped = max(self.total.skipped, skipped)
        if samples is None:
            return
        self.total.max_lag = max(self.total.max_lag, samples)
        if self._metrics is not None:
            self._metrics.lag.set(samples)

    def cut_took(self, seconds: float) -> None:
        """A delta's cut held training ``seconds``."""
        if self._metrics is not None:
            self._metrics.cut_seconds.observe(seconds)

    def published(self, seconds: float) -> None:
        """A delta was published ``seconds`` after its cut began."""
        if self._metrics is not None:
            self._metrics.publish_seconds.observe(seconds)

    def rows(self, n: int) -> None:
        self.total.rows += n
        if self._metrics is not None:
            self._metrics.samples.inc(n)

    def tally(self, result: FollowResult) -> None:
        """This book's counts and scores into a run's ``result``."""
        t = self.total
        result.rows, result.duplicates, result.refused = t.rows, t.duplicates, t.refused
        result.max_lag_samples, result.progressive = t.max_lag, list(self.windows)
        result.skipped_records = t.skipped
        result.progressive_total = self.progressive.total()
        result.progressive_final = self.final.figures() if self.keyed else None

    def moved(self, positions: dict[str, int]) -> bool:
        """A keyed stream read past what the last delta recorded (samples dropped as duplicates,
        refused): a delta is due even when no row changed, else a restart re-reads records the
        job handled, and only the bounded key window stands between them and a second training."""
        return self.keyed and any(at != self._recorded.get(unit, 0) for unit, at in positions.items())

    def write(self, ddir: Path, positions: dict[str, int]) -> None:
        """Write the delta's record (positions, counts and scores since the last, keys)."""
        self.take(Path(ddir), positions)()

    def take(self, ddir: Path, positions: dict[str, int]) -> Callable[[], DeltaManifest]:
        """The delta's record as of now, the book moved past it: returns what writes its files
        into ``ddir`` (on the cut's own thread: it reads no state that training changes)."""
        score = self.progressive.close_window()
        t, c = self.total, self._cut
        record = DeltaManifest(self.source, positions, t.rows - c.rows, t.duplicates - c.duplicates,
                               score.auc, score.logloss)  # fmt: skip
        keys = None
        if self.keyed:
            record, keys = self._take_keys(ddir, record)
        self._recorded = dict(positions)
        self.mark_cut()
        if score.samples:
            self.windows.append(score)
        if self._metrics is not None:
            self._metrics.deltas.inc()
            for unit, at in positions.items():
                self._metrics.offset.labels(unit).set(at)
            if score.samples:
                if score.auc is None:  # one class only: the gauge keeps the last AUC, a guard never reads NaN
                    self._metrics.one_class.inc()
                else:
                    self._metrics.auc.set(score.auc)
                self._metrics.logloss.set(score.logloss or 0.0)
            for k, v in self.final.figures().items():
                if k in self._metrics.final and v is not None:
                    self._metrics.final[k].set(v)
        return lambda: write_delta(ddir, record, keys)

    def _take_keys(self, ddir: Path, record: DeltaManifest) -> tuple[DeltaManifest, tuple[NDArray[np.bytes_], NDArray[np.float64]]]:  # fmt: skip
        """The record and the keys of its key file: those trained since the last delta, or the
        whole window when one is due (``WHOLE_MIN_KEYS``). The arrays are never changed in place
        (``TrainedKeys`` replaces them), so they are written as they are now."""
        _, keys, ts = self.since_cut()
        since = self.keys.newest - self.window_s if np.isfinite(self.keys.newest) else None
        added = self._added + len(keys)
        # the keys added since the whole file against those held before them (its window)
        if (
            self._keys_at is None
            or self._links >= WHOLE_EVERY
            or added >= max(WHOLE_MIN_KEYS, self.keys.size - added)
        ):
            record, window = replace(record, keys_since=since), self.keys.arrays()  # trimmed to the window
        else:
            after = os.path.relpath(self._keys_at, ddir)
            record = replace(record, keys_after=after, keys_since=since, keys_links=self._links + 1,
                             keys_added=added)  # fmt: skip
            window = (keys, ts)
        self._keys_at, self._links, self._added = ddir, record.keys_links, record.keys_added
        return record, window

    def since_cut(self) -> tuple[Counts, NDArray[np.bytes_], NDArray[np.float64]]:
        """The counts and the keys (with their times) since the last delta."""
        t, c = self.total, self._cut
        counts = Counts(t.rows - c.rows, t.duplicates - c.duplicates, t.refused - c.refused)
        parts = self._since_cut or [(np.zeros(0, "S1"), np.zeros(0, np.float64))]
        width = max(k.dtype.itemsize for k, _ in parts)
        return (
            counts,
            np.concatenate([k.astype(f"S{width}") for k, _ in parts]),
            np.concatenate([t for _, t in parts]),
        )

    def mark_cut(self) -> None:
        """What was trained so far is in a delta (this rank's or, with ranks, rank 0's)."""
        t = self.total
        self._cut, self._since_cut = Counts(t.rows, t.duplicates, t.refused, t.max_lag), []

    def resume(self, vdir: Path, ledger: Ledger) -> None:
        """A stream resumes where the version's last delta says (offsets and keys trained), over
        the ledger file, which a crash between a delta's _SUCCESS and its commit left behind. A
        version without a record of the stream (a new CURRENT moved to: ``training.follow.current``)
        keeps the keys and offsets as they are; its first delta is due as soon as the stream was
        read at all, and its first key file holds the whole window."""
        last = last_record(vdir) if self.keyed else None
        self._keys_at, self._recorded = None, {}
        if last is not None and last[0].source == self.source:
            ledger.resume(last[0].positions)
            self._recorded = dict(last[0].positions)
            self._keys_at = last[1] if last[0].keys else None
            self._links, self._added = last[0].keys_links, last[0].keys_added
            self.keys = TrainedKeys(self.window_s, *read_keys(last[1], last[0]))
            log.info("resuming at %s, %d keys trained (%s)", last[0].positions, len(self.keys), last[1])

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
