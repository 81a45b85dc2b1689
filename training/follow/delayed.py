"""Losses that know clicks come late: ``recserve train --follow --stream --delayed-feedback``.

With ``recserve join --attribution-s`` an item whose click comes after its first horizon
(``--label-after-s``) reaches the trainer twice: first as a negative, then as a positive of kind
CORRECTION (``stream.records``). Trained as they are (``none``) every late click is a fake negative
as well as a positive, and the model under-predicts. The weighted losses put the expectation back
(importance weights on the binary cross-entropy; ``p`` the model's own prediction for the sample,
held constant in the gradient):

- ``fnw``, fake negative weighting (Ktena et al., "Addressing Delayed Feedback for Continuous
  Training with Neural Networks in CTR prediction", RecSys 2019): assumes every positive came as a
  negative first. Positives weigh ``1 + p``, negatives ``(1 - p)(1 + p)``.
- ``esdfm``, elapsed-time aware (after ES-DFM, Yang et al., AAAI 2021): only clicks later than the
  label's horizon came as a negative first; their share among a sample's clicks is ``1 - F(e)``,
  ``F`` the distribution of click delays and ``e`` the horizon its label waited (a negative's
  ``elapsed``; for a positive, the horizon the negatives carry). With ``f = p (1 - F(e))`` (the
  chance the negative is a click to come) positives weigh ``1 + f``, negatives
  ``(1 + f)(1 - p) / (1 - p + f)``. ``F`` is measured here, from the delays of the clicks trained
  (``DelayCdf``: a histogram, every click of either kind); where no click was seen yet it is 0,
  and ``esdfm`` is ``fnw``. Delays longer than any seen are missing from it at first (the
  histogram under-counts the tail until they come), so early on it leans towards ``fnw``.

Every weight is computed over the whole batch at once (no loop per sample).

**Where each loss settles** (``settles_at``): with ``p`` an item's final click probability and ``q``
the share of its clicks within the first horizon, the stream holds per impression ``P`` positives
(``p`` with corrections: ``p q`` first labels and ``p (1 - q)`` corrections; ``p q`` without) and
``N = 1 - p q`` negatives. The weighted loss is least where ``P w+ (1 - m) = N w- m``, at ``m = P /
(N + P s)``, ``s`` the share of clicks the loss takes for ones that never came as a negative:
``none`` 1 (``m = P / (P + N)``), ``fnw`` 0 (``m = P / N = p / (1 - p q)`` with corrections: it
over-predicts by ``1 / (1 - p q)``, right only when every click is late, ``q = 0``), ``esdfm`` its
measured ``F(horizon)``: ``q`` with corrections (``m = p``), 1 without (every click trained came within
the horizon).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

MODES = ("none", "fnw", "esdfm")

EDGES = np.concatenate([[0.0], np.geomspace(0.01, 30 * 86_400.0, 96)])
"""The delay histogram's bin edges (seconds): 10 ms to 30 days, log-spaced, and a bin past each end."""


def _check(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"--delayed-feedback must be one of {', '.join(MODES)}, got {mode!r}")


def settles_at(mode: str, p: NDArray[np.floating], q: float, correcting: bool) -> NDArray[np.float64]:
    """The prediction ``mode``'s loss settles at for items of final click probability ``p`` whose
    clicks come within the first horizon with share ``q`` (later ones, when ``correcting``, as a
    negative and then a correction, else as a negative alone); see the module's docstring."""
    _check(mode)
    p = np.asarray(p, np.float64)
    positives, negatives = (p if correcting else p * q), 1.0 - p * q
    s = {"none": 1.0, "fnw": 0.0, "esdfm": q if correcting else 1.0}[mode]
    return positives / (negatives + positives * s)


class DelayCdf:
    """The distribution of click delays (seconds from the impression), from the clicks seen."""

    def __init__(self) -> None:
        self.counts = np.zeros(len(EDGES) + 1, np.float64)

    def add(self, delays: NDArray[np.floating]) -> None:
        if len(delays):
            self.counts += np.bincount(np.searchsorted(EDGES, delays, "right"), minlength=len(self.counts))

    def at(self, elapsed: NDArray[np.floating]) -> NDArray[np.float64]:
        """F(elapsed): the share of clicks seen whose delay was at most ``elapsed`` (to the bin)."""
        total = self.counts.sum()
        if not total:
            return np.zeros(len(elapsed))
        cdf = np.cumsum(self.counts) / total
        return cdf[np.searchsorted(EDGES, elapsed, "right")]


class DelayedFeedback:
    """The weights of a batch's samples under ``mode`` (one of ``MODES``)."""

    def __init__(self, mode: str) -> None:
        _check(mode)
        self.mode, self.delays = mode, DelayCdf()
        self.horizon = float("inf")  # how long a negative's label waited (the joiner's --label-after-s)

    def weights(self, p: NDArray[np.floating], labels: NDArray[np.floating],
                elapsed: NDArray[np.floating]) -> NDArray[np.float32] | None:  # fmt: skip
        """Per sample, its weight in the loss (None: ``none``, every sample weighs 1). ``p``: the
        model's predictions for them before this step; ``elapsed``: each label's delay."""
        clicked = labels > 0
        self.delays.add(elapsed[clicked])
        if not clicked.all():
            self.horizon = float(elapsed[~clicked].max())
        if self.mode == "none":
            return None
        p = np.clip(p.astype(np.float64), 0.0, 1.0 - 1e-6)
        waited = np.where(clicked, self.horizon, elapsed)  # no negative seen yet: F(inf) = 1, f = 0
        later = 1.0 - (self.delays.at(waited) if self.mode == "esdfm" else 0.0)
        f = p * later  # the chance a negative is a click still to come
        w = np.where(clicked, 1.0 + f, (1.0 + f) * (1.0 - p) / (1.0 - p + f))
        return w.astype(np.float32)
