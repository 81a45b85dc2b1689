"""training.evaluate: AUC and logloss in numpy give what scikit-learn gave (the functions they
replace), and the training curve is a well-formed SVG with every series drawn."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import log_loss, roc_auc_score

from training.config import TrainConfig
from training.evaluate import History, auc, auc_logloss, logloss, plot_curve

SVG = "{http://www.w3.org/2000/svg}"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 6)), min_size=2, max_size=60))
def test_auc_equals_scikit_learns_with_ties(rows):
    labels = np.array([y for y, _ in rows], dtype=np.float32)
    scores = np.array([s / 6 for _, s in rows], dtype=np.float32)  # 7 values: many ties
    if len(np.unique(labels)) < 2:
        assert np.isnan(auc(labels, scores))
    else:
        assert auc(labels, scores) == pytest.approx(roc_auc_score(labels, scores), rel=1e-12, abs=1e-12)


def test_auc_and_logloss_equal_scikit_learns_on_a_large_split():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=200_000)
    labels = (rng.random(200_000) < 1 / (1 + np.exp(-2 * logits))).astype(np.float32)
    scores = np.round(1 / (1 + np.exp(-logits)), 3).astype(np.float32)  # float32, rounded: ties
    got_auc, got_loss = auc_logloss(labels, scores)
    assert got_auc == pytest.approx(roc_auc_score(labels, scores), rel=1e-12)
    p = np.clip(scores.astype(np.float64), 1e-7, 1 - 1e-7)  # what the scikit-learn version did
    assert got_loss == pytest.approx(log_loss(labels, p, labels=[0, 1]), rel=1e-12)


def test_auc_edges():
    assert auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.2, 0.3, 0.4])) == 1.0
    assert auc(np.array([1, 1, 0, 0]), np.array([0.1, 0.2, 0.3, 0.4])) == 0.0
    assert auc(np.array([0, 1]), np.array([0.5, 0.5])) == 0.5
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        auc(np.array([0, 2]), np.array([0.1, 0.2]))
    with pytest.raises(ValueError, match="2 labels but 3 scores"):
        auc(np.array([0, 1]), np.array([0.1, 0.2, 0.3]))


def test_logloss_clips_certain_wrong_answers():
    assert logloss(np.array([1.0, 0.0]), np.array([0.0, 1.0])) == pytest.approx(-np.log(1e-7))


def test_the_curve_is_an_svg_with_each_series(tmp_path):
    h = History(steps=list(range(1, 101)), loss=list(np.linspace(0.7, 0.45, 100)), eval_steps=[50, 100],
                auc=[0.70, float("nan")], logloss=[0.50, 0.47])  # fmt: skip
    path = plot_curve(h, tmp_path / "eval" / "curve.svg", title="criteo: dlrm <&>")
    root = ET.parse(path).getroot()  # well-formed XML (the title's <&> escaped)
    assert root.tag == f"{SVG}svg"
    lines = root.findall(f".//{SVG}polyline")
    assert len(lines) == 4  # train loss, its moving mean, test logloss; test AUC
    assert (
        len(lines[0].get("points").split()) == 100 and len(lines[3].get("points").split()) == 1
    )  # NaN left out
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert "criteo: dlrm <&>" in texts and "test AUC" in texts and "train loss (mean of 5)" in texts


def test_an_empty_history_still_draws_the_axes(tmp_path):
    root = ET.parse(plot_curve(History(), tmp_path / "c.svg")).getroot()
    assert not root.findall(f".//{SVG}polyline") and len(root.findall(f".//{SVG}rect")) == 3


def test_the_config_refuses_a_curve_that_is_not_svg():
    with pytest.raises(ValueError, match=r"--curve must end in \.svg, got 'c\.png'"):
        TrainConfig(curve="c.png")
