"""Predictions tallied in bounded memory, for figures over a whole run: the scores of each label in
a histogram of ``bins`` bins over [0, 1] (the AUC the histogram's, ties within a bin counting half:
off the exact one by at most half the share of positive-negative pairs that share a bin), the log loss and the scores summed. Nothing grows with the
samples (``training.follow.progressive``'s whole run, ``training.follow.final_labels``)."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

EPS = 1e-7
"""Scores are clipped to [EPS, 1 - EPS] (``training.evaluate.logloss``'s)."""


class Tally:
    def __init__(self, bins: int) -> None:
        self.bins = bins
        self.pos, self.neg = np.zeros(bins, np.int64), np.zeros(bins, np.int64)
        self.loss, self.sum_p = 0.0, 0.0

    def add(self, clicked: NDArray[np.bool_], p: NDArray[np.float64]) -> None:
        """Samples positive where ``clicked``, scored ``p`` (clipped: ``clip``)."""
        self.pos += np.bincount(self.bin(p[clicked]), minlength=self.bins)
        self.neg += np.bincount(self.bin(p[~clicked]), minlength=self.bins)
        self.loss -= np.log(p[clicked]).sum() + np.log1p(-p[~clicked]).sum()
        self.sum_p += p.sum()

    def turn_positive(self, p: NDArray[np.float64]) -> None:
        """Negatives tallied at scores ``p`` turned out positive."""
        np.subtract.at(self.neg, self.bin(p), 1)
        np.add.at(self.pos, self.bin(p), 1)
        self.loss += (np.log1p(-p) - np.log(p)).sum()

    def merge(self, other: Tally, sign: int = 1) -> None:
        """``other``'s samples added (``sign`` -1: taken away)."""
        self.pos += sign * other.pos
        self.neg += sign * other.neg
        self.loss += sign * other.loss
        self.sum_p += sign * other.sum_p

    def copy(self) -> Tally:
        out = Tally(self.bins)
        out.merge(self)
        return out

    @property
    def samples(self) -> int:
        return int(self.pos.sum() + self.neg.sum())

    def auc(self) -> float | None:
        """None unless both labels were tallied."""
        npos = int(self.pos.sum())
        pairs = npos * (self.samples - npos)
        below = np.cumsum(self.neg) - self.neg  # negatives in lower bins
        return float((self.pos * (below + 0.5 * self.neg)).sum() / pairs) if pairs else None

    def logloss(self) -> float | None:
        return self.loss / self.samples if self.samples else None

    def bin(self, p: NDArray[np.float64]) -> NDArray[np.int64]:
        return np.minimum((p * self.bins).astype(np.int64), self.bins - 1)


def clip(scores: NDArray[np.floating]) -> NDArray[np.float64]:
    return np.clip(scores.astype(np.float64), EPS, 1 - EPS)
