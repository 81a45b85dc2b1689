"""Progressive validation against the final labels (``recserve join --attribution-s``): a sample
whose item is corrected later (a click after its first horizon: the same item again, kind
CORRECTION) counts as the positive it turned out to be, scored as it was when its first label
trained.

Every first label is counted as it trains (its score before training, in a histogram of
``BINS`` score bins per label, and the log loss and calibration sums); a negative's key is kept
with its score (``TrainedKeys`` with values, over the trainer's ``--dedup-window-s``), and when its
correction trains, its count moves from the negatives to the positives with its score. Nothing
grows with the run but the keys of the window. The AUC is the histogram's (ties within a bin count
half: within about 1/BINS of the exact one); a correction whose first label is not held (trained
before a restart, or out of the window) is counted ``unmatched`` and left out.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from stream.records import LABEL
from stream.sample_batch import KIND_BIT
from training.follow.trained_keys import TrainedKeys

BINS = 1000
_EPS = 1e-7


class FinalLabels:
    def __init__(self, window_s: float) -> None:
        self.negatives = TrainedKeys(window_s)
        self.pos, self.neg = np.zeros(BINS, np.int64), np.zeros(BINS, np.int64)
        self.loss, self.sum_p, self.corrected, self.unmatched = 0.0, 0.0, 0, 0

    def add(self, keys: NDArray[np.bytes_], kinds: NDArray[np.uint8], ts: NDArray[np.float64],
            labels: NDArray[np.float32], scores: NDArray[np.float32]) -> None:  # fmt: skip
        """A trained batch: its keys, kinds, label times, labels and scores before training."""
        first = kinds == LABEL
        p = np.clip(scores[first].astype(np.float64), _EPS, 1 - _EPS)
        y = labels[first] > 0
        self.pos += np.bincount(_bin(p[y]), minlength=BINS)
        self.neg += np.bincount(_bin(p[~y]), minlength=BINS)
        self.loss -= np.log(p[y]).sum() + np.log1p(-p[~y]).sum()
        self.sum_p += p.sum()
        bits = p[~y].astype(np.float32).view(np.int32).astype(np.int64)  # >= 0: a score's bits
        self.negatives.add(keys[first][~y], ts[first][~y], bits)
        if first.all():
            return
        found = self.negatives.find(_label_keys(keys[~first]))
        self.unmatched += int((found < 0).sum())
        p0 = found[found >= 0].astype(np.int32).view(np.float32).astype(np.float64)
        np.subtract.at(self.neg, _bin(p0), 1)
        np.add.at(self.pos, _bin(p0), 1)
        self.loss += (np.log1p(-p0) - np.log(p0)).sum()
        self.corrected += len(p0)

    @property
    def samples(self) -> int:
        return int(self.pos.sum() + self.neg.sum())

    def figures(self) -> dict[str, float | int | None]:
        """AUC, log loss and calibration (mean score over the share positive) against the final
        labels, the samples, corrections matched and unmatched."""
        n, npos = self.samples, int(self.pos.sum())
        below = np.cumsum(self.neg) - self.neg  # negatives in lower bins
        pairs = npos * (n - npos)
        auc = float((self.pos * (below + 0.5 * self.neg)).sum() / pairs) if pairs else None
        return {"samples": n, "auc": None if auc is None else round(auc, 6),
                "logloss": round(self.loss / n, 6) if n else None,
                "calibration": round(self.sum_p / npos, 6) if npos else None,
                "corrected": self.corrected, "unmatched": self.unmatched}  # fmt: skip


def _bin(p: NDArray[np.float64]) -> NDArray[np.int64]:
    return np.minimum((p * BINS).astype(np.int64), BINS - 1)


def _label_keys(keys: NDArray[np.bytes_]) -> NDArray[np.bytes_]:
    """The keys of the first labels that corrections ``keys`` correct (the kind bit cleared)."""
    raw = (
        np.frombuffer(np.ascontiguousarray(keys).tobytes(), np.uint8)
        .reshape(len(keys), keys.dtype.itemsize)
        .copy()
    )
    raw[:, 0] &= ~np.uint8(KIND_BIT >> 24)
    return raw.view(keys.dtype).ravel()
