"""The records of ``training.follow``: what a run did (printed as JSON) and the version it trains."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from training.progressive import Score

if TYPE_CHECKING:
    from torch import nn

    import model_store as ms
    from features.schema import Schema
    from training.cluster import Cluster
    from training.ctx import TrainCtx


@dataclass
class FollowResult:
    """What a follow run did."""

    version: str = ""  # the version followed last
    deltas: list[tuple[str, int]] = field(default_factory=list)  # (version, seq) cut
    files: list[str] = field(default_factory=list)  # units (files) trained on (completely or partly)
    rows: int = 0  # training rows
    duplicates: int = 0  # samples dropped: their key was trained already
    refused: int = 0  # malformed records (sent to the dead-letter topic)
    progressive: list[Score] = field(default_factory=list)  # per delta: scored before training
    progressive_total: Score | None = None
    steps: int = 0
    reloads: int = 0  # CURRENT changes followed
    full_versions: list[str] = field(default_factory=list)  # written and published (--full-every)
    refused_versions: list[str] = field(default_factory=list)  # written, refused by the gate
    seconds: float = 0.0
    train_seconds: float = 0.0  # from the first rows read to the end (samples/s = rows / this)
    max_lag_samples: int = 0  # a stream's most samples behind its partitions' ends, at a look


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
