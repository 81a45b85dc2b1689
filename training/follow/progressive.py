"""Progressive validation, the measure online learning is judged by: every batch is scored by the
model as it stands before the batch trains it, so each sample is a test sample once (Google's
"Ad Click Prediction: a View from the Trenches", sec. 5.1). AUC and log loss per window (the
samples of one delta, exact) and over the whole run (a ``training.follow.tally`` of ``TOTAL_BINS``
bins: a streaming trainer runs for days, and keeping every sample's label and score grew it by 8
bytes a sample).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from training.follow.tally import Tally, clip
from training.follow.types import Score

WINDOWS_KEPT = 10_000
"""Per-window scores kept (the newest; each delta's record has its own): a run of days cuts
hundreds of thousands."""
TOTAL_BINS = 1 << 18
"""The whole run's histogram bins (4 MB): scores under 4e-6 apart tie (200 clustered samples: 1.4e-4
off the exact AUC, one pair in 7,500; millions spread over the bins: about 1e-5)."""


@dataclass
class Progressive:
    """Labels and pre-training scores of the window open now, tallied over the whole run."""

    windows: deque[Score] = field(default_factory=lambda: deque(maxlen=WINDOWS_KEPT))
    _open: list[tuple[NDArray[np.float32], NDArray[np.float32]]] = field(default_factory=list)
    _all: Tally = field(default_factory=lambda: Tally(TOTAL_BINS))

    def add(self, labels: NDArray[np.float32], scores: NDArray[np.float32]) -> None:
        self._open.append((labels, scores))

    def close_window(self) -> Score:
        """Score the window open now, and open the next."""
        labels, scores = self._close()
        score = Score.of(labels, scores)
        if score.samples:
            self.windows.append(score)
        return score

    def take_window(self) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
        """The labels and scores of the window open now, which another's window (rank 0's) will
        score; the next opens."""
        return self._close()

    def _close(self) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
        labels, scores = _cat(self._open)
        self._all.add(labels > 0, clip(scores))
        self._open = []
        return labels, scores

    def total(self) -> Score:
        """The whole run's (the window open now included)."""
        t = self._all.copy()
        labels, scores = _cat(self._open)
        t.add(labels > 0, clip(scores))
        auc, logloss = t.auc(), t.logloss()
        return Score(
            t.samples, None if auc is None else round(auc, 6), None if logloss is None else round(logloss, 6)
        )


def _cat(parts: list[tuple[NDArray[np.float32], NDArray[np.float32]]]) -> tuple[NDArray[np.float32], NDArray[np.float32]]:  # fmt: skip
    if not parts:
        return np.zeros(0, np.float32), np.zeros(0, np.float32)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
