"""Progressive validation, the measure online learning is judged by: every batch is scored by the
model as it stands before the batch trains it, so each sample is a test sample once (Google's
"Ad Click Prediction: a View from the Trenches", sec. 5.1). AUC and log loss per window (the
samples of one delta) and over the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from training.follow.types import Score


@dataclass
class Progressive:
    """Labels and pre-training scores of the window open now and of the whole run."""

    windows: list[Score] = field(default_factory=list)
    _open: list[tuple[NDArray[np.float32], NDArray[np.float32]]] = field(default_factory=list)
    _all: list[tuple[NDArray[np.float32], NDArray[np.float32]]] = field(default_factory=list)

    def add(self, labels: NDArray[np.float32], scores: NDArray[np.float32]) -> None:
        self._open.append((labels, scores))

    def close_window(self) -> Score:
        """Score the window open now, and open the next."""
        labels, scores = _cat(self._open)
        self._all += self._open
        self._open = []
        score = Score.of(labels, scores)
        if score.samples:
            self.windows.append(score)
        return score

    def take_window(self) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
        """The labels and scores of the window open now, which another's window (rank 0's) will
        score; the next opens."""
        labels, scores = _cat(self._open)
        self._all += self._open
        self._open = []
        return labels, scores

    def total(self) -> Score:
        return Score.of(*_cat(self._all + self._open))


def _cat(parts: list[tuple[NDArray[np.float32], NDArray[np.float32]]]) -> tuple[NDArray[np.float32], NDArray[np.float32]]:  # fmt: skip
    if not parts:
        return np.zeros(0, np.float32), np.zeros(0, np.float32)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
