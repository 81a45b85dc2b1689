"""Predictions tallied in bounded memory: the histogram's AUC within a bin of the exact one, the
log loss exact, negatives turned positive where their scores were."""

from __future__ import annotations

import numpy as np
import pytest

from training.evaluate import auc_logloss
from training.follow.progressive import TOTAL_BINS, Progressive
from training.follow.tally import Tally, clip


def test_the_tally_matches_the_exact_figures_to_its_bins():
    rng = np.random.default_rng(0)
    p = rng.random(20_000).astype(np.float32)
    y = (rng.random(20_000) < p).astype(np.float32)
    t = Tally(TOTAL_BINS)
    t.add(y > 0, clip(p))
    auc, logloss = auc_logloss(y, p)
    assert t.auc() == pytest.approx(auc, abs=2.0 / TOTAL_BINS) and t.logloss() == pytest.approx(
        logloss, rel=1e-9
    )
    assert Tally(10).auc() is None and Tally(10).logloss() is None


def test_a_negative_turned_positive_counts_at_its_score():
    t = Tally(100)
    t.add(np.array([True, False, False]), clip(np.array([0.9, 0.2, 0.6])))
    t.turn_positive(clip(np.array([0.6])))
    auc, logloss = auc_logloss(np.array([1, 0, 1.0]), np.array([0.9, 0.2, 0.6]))
    assert (t.auc(), t.logloss()) == (pytest.approx(auc), pytest.approx(logloss))


def test_the_whole_runs_figures_hold_no_sample():
    prog = Progressive()
    rng = np.random.default_rng(1)
    for _ in range(5):
        p = rng.random(1000).astype(np.float32)
        prog.add((rng.random(1000) < p).astype(np.float32), p)
        prog.close_window()
    prog.add(np.ones(3, np.float32), np.full(3, 0.5, np.float32))  # a window still open counts
    assert prog.total().samples == 5003 and prog._open and prog._all.samples == 5000
    assert len(prog.windows) == 5
