"""The streaming trainer's nouns, first (as torchrec's planner keeps its own in ``types.py``): what
a window's predictions scored (``Score``), what a trainer counted (``Counts``), what one rank trained
since the last cut (``Share``), the version it trains (``Loaded``) and what a run did
(``FollowResult``, printed as JSON by ``recserve train --follow``). The modules beside it do the work:
``trainer`` (the loop), ``steps`` (a consume's steps), ``book`` (what is kept between deltas),
``ranks`` (torchrun), ``current`` (the version to follow next), ``cut`` (the one delta cut),
``standby``, ``tables``, ``full_version``, ``progressive``, ``trained_keys``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from training.evaluate import auc_logloss

if TYPE_CHECKING:
    from torch import nn

    import model_store as ms
    from features.schema import Schema
    from training.cluster import Cluster
    from training.ctx import TrainCtx
    from training.follow.final_labels import FinalPart


@dataclass(frozen=True)
class Score:
    """AUC and log loss of ``samples`` predictions made before training on them (AUC None: one
    class only)."""

    samples: int
    auc: float | None
    logloss: float | None

    @classmethod
    def of(cls, labels: NDArray[np.float32], scores: NDArray[np.float32]) -> Score:
        if not len(labels):
            return cls(0, None, None)
        auc, logloss = auc_logloss(labels, scores)
        return cls(len(labels), None if math.isnan(auc) else round(auc, 6), round(logloss, 6))


@dataclass
class Counts:
    rows: int = 0
    duplicates: int = 0
    refused: int = 0
    max_lag: int = 0
    skipped: int = 0  # records the source read past, gone


@dataclass
class Share:
    """What one rank trained since the last cut, for rank 0's delta record."""

    positions: dict[str, int]
    keys: NDArray[np.bytes_]
    ts: NDArray[np.float64]
    labels: NDArray[np.float32]
    scores: NDArray[np.float32]
    rows: int
    duplicates: int
    refused: int
    changed: bool
    final: FinalPart | None = None  # its final-label tally since the last cut (another rank's)


@dataclass
class FollowResult:
    """What a follow run did."""

    version: str = ""  # the version followed last
    deltas: list[tuple[str, int]] = field(default_factory=list)  # (version, seq) cut
    files: list[str] = field(default_factory=list)  # units (files) trained on (completely or partly)
    rows: int = 0  # training rows
    duplicates: int = 0  # samples dropped: their key was trained already
    refused: int = 0  # malformed records (sent to the dead-letter topic)
    progressive: list[Score] = field(default_factory=list)  # the newest deltas, scored before training
    progressive_total: Score | None = None
    progressive_final: dict | None = None  # --stream: against the final labels (training.follow.final_labels)
    steps: int = 0
    reloads: int = 0  # CURRENT changes followed
    full_versions: list[str] = field(default_factory=list)  # written and published (--full-every)
    refused_versions: list[str] = field(default_factory=list)  # written, refused by the gate
    seconds: float = 0.0
    train_seconds: float = 0.0  # from the first rows read to the end (samples/s = rows / this)
    max_lag_samples: int = 0  # a stream's most samples behind its partitions' ends, at a look
    skipped_records: int = 0  # a stream's records gone (its retention passed them) when read past


@dataclass
class Loaded:
    """One version, ready to train: its shards, worker, frozen dense model, schema."""

    version: str
    vdir: Path
    schema: Schema
    cluster: Cluster
    ctx: TrainCtx
    dense: nn.Module
    manifest: ms.VersionManifest
