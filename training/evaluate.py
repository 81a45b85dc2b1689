"""Evaluation (AUC and logloss from scikit-learn) and the training-curve plot."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from features.batch import CompactBatch


@dataclass
class EvalResult:
    auc: float
    logloss: float
    scores: np.ndarray  # sigmoid probabilities, float32, in row order
    labels: np.ndarray
    pooled: np.ndarray  # dense-network inputs of the first rows (export verification)
    dense: np.ndarray

    def metrics(self) -> dict[str, float]:
        return {"auc": self.auc, "logloss": self.logloss}


def sigmoid(logits: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-logits.astype(np.float64)))).astype(np.float32)


def auc_logloss(labels: np.ndarray, scores: np.ndarray) -> tuple[float, float]:
    from sklearn.metrics import log_loss, roc_auc_score

    auc = float(roc_auc_score(labels, scores)) if len(np.unique(labels)) == 2 else float("nan")
    p = np.clip(scores.astype(np.float64), 1e-7, 1 - 1e-7)
    return auc, float(log_loss(labels, p, labels=[0, 1]))


def evaluate(ctx, batches: Iterable[CompactBatch], keep: int = 8192) -> EvalResult:
    """Score every batch with ``ctx.predict`` (no inserts, eval mode) in one pass over them and
    compute the metrics. The dense-network inputs are kept for the first ``keep`` rows only (they
    verify the export; a streamed test split may be any size)."""
    logits: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    pooled: list[np.ndarray] = []
    dense: list[np.ndarray] = []
    kept = 0
    for b in batches:
        if b.labels is None:
            raise ValueError("an evaluation batch has no labels")
        p = ctx.predict(b)
        logits.append(p.logits)
        labels.append(b.labels)
        if kept < keep:
            pooled.append(p.pooled[: keep - kept])
            dense.append(p.dense[: keep - kept])
            kept += len(pooled[-1])
    scores = sigmoid(np.concatenate(logits))
    all_labels = np.concatenate(labels)
    auc, logloss = auc_logloss(all_labels, scores)
    return EvalResult(auc, logloss, scores, all_labels, np.concatenate(pooled), np.concatenate(dense))


@dataclass
class History:
    """What the curve shows: the training loss per step and the test metrics per epoch."""

    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    auc: list[float] = field(default_factory=list)
    logloss: list[float] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {k: list(v) for k, v in self.__dict__.items()}


def plot_curve(history: History, path: str | Path, title: str = "") -> Path:
    """A PNG with the training loss (smoothed) and test logloss on the left, test AUC on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(10, 4))
    if history.loss:
        loss = np.asarray(history.loss)
        k = max(1, len(loss) // 20)
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        ax_loss.plot(history.steps, loss, alpha=0.3, label="train loss")
        ax_loss.plot(history.steps[k - 1 :], smooth, label=f"train loss (mean of {k})")
    if history.eval_steps:
        ax_loss.plot(history.eval_steps, history.logloss, "o-", label="test logloss")
        ax_auc.plot(history.eval_steps, history.auc, "o-", color="C2", label="test AUC")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("logloss")
    ax_loss.legend()
    ax_auc.set_xlabel("step")
    ax_auc.set_ylabel("AUC")
    ax_auc.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
