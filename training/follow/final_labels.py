"""Progressive validation against the final labels (``recserve join --attribution-s``): a sample
whose item is corrected later (a click after its first horizon: the same item again, kind
CORRECTION) counts as the positive it turned out to be, scored as it was when its first label
trained.

Every first label is counted as it trains (its score before training, in a ``training.follow.tally``
of ``BINS`` score bins per label, and the log loss and calibration sums); a negative's key is kept
with its score (``TrainedKeys`` with values, over the trainer's ``--dedup-window-s``), and when its
correction trains, its count moves from the negatives to the positives with its score. Nothing
grows with the run but the keys of the window. The AUC is the histogram's (ties within a bin count
half: within about 1/BINS of the exact one); a correction whose first label is not held (trained
before a restart, or out of the window) is counted ``unmatched`` and left out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from stream.records import LABEL
from stream.sample_batch import KIND_BIT
from training.follow.tally import Tally, clip
from training.follow.trained_keys import TrainedKeys

BINS = 1000


@dataclass
class FinalPart:
    """What one rank tallied since it last sent its part (``FinalLabels.take``): under torchrun,
    rank 0's figures are the job's (a correction trains on the rank its first label did: the
    partition is the request's)."""

    tally: Tally
    corrected: int
    unmatched: int


class FinalLabels:
    def __init__(self, window_s: float) -> None:
        self.negatives = TrainedKeys(window_s)
        self.tally = Tally(BINS)
        self.corrected, self.unmatched = 0, 0
        self._sent = FinalPart(Tally(BINS), 0, 0)

    def take(self) -> FinalPart:
        """What this rank tallied since its last ``take``, for rank 0's (``merge``)."""
        part = FinalPart(
            self.tally.copy(), self.corrected - self._sent.corrected, self.unmatched - self._sent.unmatched
        )
        part.tally.merge(self._sent.tally, -1)
        self._sent = FinalPart(self.tally.copy(), self.corrected, self.unmatched)
        return part

    def merge(self, part: FinalPart) -> None:
        """Another rank's part (rank 0: its figures become the job's)."""
        self.tally.merge(part.tally)
        self.corrected += part.corrected
        self.unmatched += part.unmatched

    def add(self, keys: NDArray[np.bytes_], kinds: NDArray[np.uint8], ts: NDArray[np.float64],
            labels: NDArray[np.float32], scores: NDArray[np.float32]) -> None:  # fmt: skip
        """A trained batch: its keys, kinds, label times, labels and scores before training."""
        first = kinds == LABEL
        p = clip(scores[first])
        y = labels[first] > 0
        self.tally.add(y, p)
        bits = p[~y].astype(np.float32).view(np.int32).astype(np.int64)  # >= 0: a score's bits
        self.negatives.add(keys[first][~y], ts[first][~y], bits)
        if first.all():
            return
        found = self.negatives.find(_label_keys(keys[~first]))
        self.unmatched += int((found < 0).sum())
        p0 = found[found >= 0].astype(np.int32).view(np.float32).astype(np.float64)
        self.tally.turn_positive(p0)
        self.corrected += len(p0)

    @property
    def samples(self) -> int:
        return self.tally.samples

    def figures(self) -> dict[str, float | int | None]:
        """AUC, log loss and calibration (mean score over the share positive) against the final
        labels, the samples, corrections matched and unmatched."""
        t = self.tally
        auc, logloss, npos = t.auc(), t.logloss(), int(t.pos.sum())
        return {"samples": t.samples, "auc": None if auc is None else round(auc, 6),
                "logloss": None if logloss is None else round(logloss, 6),
                "calibration": round(t.sum_p / npos, 6) if npos else None,
                "corrected": self.corrected, "unmatched": self.unmatched}  # fmt: skip


def _label_keys(keys: NDArray[np.bytes_]) -> NDArray[np.bytes_]:
    """The keys of the first labels that corrections ``keys`` correct (the kind bit cleared)."""
    raw = (
        np.frombuffer(np.ascontiguousarray(keys).tobytes(), np.uint8)
        .reshape(len(keys), keys.dtype.itemsize)
        .copy()
    )
    raw[:, 0] &= ~np.uint8(KIND_BIT >> 24)
    return raw.view(keys.dtype).ravel()
