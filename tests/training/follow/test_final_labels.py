"""Progressive figures against the final labels: a corrected negative counts as the positive it
turned out to be, at the score it had when its first label trained; the histogram's AUC is the
exact one to within a bin."""

from __future__ import annotations

import numpy as np
import pytest

from stream.records import CORRECTION, LABEL
from stream.sample_batch import KIND_BIT
from training.evaluate import auc_logloss
from training.follow.final_labels import BINS, FinalLabels


def keys(items, kind_bit: int = 0, rid: bytes = b"req-1") -> np.ndarray:
    return np.array([((i | kind_bit).to_bytes(4, "big") + rid) for i in items], "S9")


def test_without_corrections_the_figures_are_the_first_labels_exact_ones():
    rng = np.random.default_rng(0)
    p = rng.random(5000).astype(np.float32)
    y = (rng.random(5000) < p).astype(np.float32)
    final = FinalLabels(window_s=3600.0)
    final.add(keys(range(5000)), np.full(5000, LABEL, np.uint8), np.zeros(5000), y, p)
    auc, logloss = auc_logloss(y, p)
    got = final.figures()
    assert got["auc"] == pytest.approx(auc, abs=1.0 / BINS) and got["logloss"] == pytest.approx(
        logloss, rel=1e-4
    )
    assert got["calibration"] == pytest.approx(p.sum() / y.sum(), rel=1e-5)
    assert (got["samples"], got["corrected"], got["unmatched"]) == (5000, 0, 0)


def test_a_correction_turns_its_first_label_positive_at_the_score_it_had():
    final = FinalLabels(window_s=3600.0)
    p = np.array([0.9, 0.2, 0.6, 0.1], np.float32)
    final.add(keys(range(4)), np.full(4, LABEL, np.uint8), np.zeros(4), np.array([1, 0, 0, 0], np.float32), p)
    # item 2 clicked late: its correction trains later, scored 0.95 by then (not what counts)
    final.add(keys([2, 7], KIND_BIT), np.full(2, CORRECTION, np.uint8), np.full(2, 60.0),
              np.ones(2, np.float32), np.array([0.95, 0.5], np.float32))  # fmt: skip
    y = np.array([1, 0, 1, 0], np.float32)  # the final labels; item 7 has no first label here
    auc, logloss = auc_logloss(y, p)
    got = final.figures()
    assert (got["auc"], got["logloss"]) == (pytest.approx(auc), pytest.approx(logloss, rel=1e-5))
    assert (got["corrected"], got["unmatched"], got["samples"]) == (1, 1, 4)
    assert got["calibration"] == pytest.approx(p.sum() / 2, rel=1e-6)
