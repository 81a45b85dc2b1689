"""Evaluation (AUC and logloss, in numpy) and the training-curve plot (an SVG written here): the
image that trains carries neither scikit-learn nor a plotting library for these two."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape

import numpy as np

from features.batch import CompactBatch
from stream.arms import auc as stream_auc


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


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve: the chance that a random positive scores above a random negative,
    a tie counting one half (Mann-Whitney U over average ranks; scikit-learn's ``roc_auc_score``).
    NaN unless both classes are present; labels must be 0 or 1."""
    y = np.asarray(labels).ravel()
    s = np.asarray(scores, dtype=np.float64).ravel()
    if len(y) != len(s):
        raise ValueError(f"{len(y)} labels but {len(s)} scores")
    pos = y == 1
    if not np.all(pos | (y == 0)):
        raise ValueError(f"labels must be 0 or 1, got {np.unique(y[~(pos | (y == 0))])[:5]}")
    return stream_auc(s, pos.astype(np.float64))  # the one implementation (stream.arms)


def logloss(labels: np.ndarray, scores: np.ndarray, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy of probabilities ``scores`` clipped to [eps, 1 - eps]."""
    y = np.asarray(labels, dtype=np.float64).ravel()
    p = np.clip(np.asarray(scores, dtype=np.float64).ravel(), eps, 1 - eps)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def auc_logloss(labels: np.ndarray, scores: np.ndarray) -> tuple[float, float]:
    return auc(labels, scores), logloss(labels, scores)


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
    return EvalResult(
        *auc_logloss(all_labels, scores), scores, all_labels, np.concatenate(pooled), np.concatenate(dense)
    )


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


WIDTH, HEIGHT, PAD = 500, 380, 70  # one panel's size and its margin for ticks and labels (px)


def plot_curve(history: History, path: str | Path, title: str = "") -> Path:
    """An SVG with the training loss (raw and smoothed) and the test logloss on the left panel, the
    test AUC on the right, each with its axis range in ticks."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    left: list[Series] = []
    if history.loss:
        loss = np.asarray(history.loss, dtype=np.float64)
        k = max(1, len(loss) // 20)
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        left += [Series(history.steps, loss, "#1f77b4", "train loss", opacity=0.3),
                 Series(history.steps[k - 1 :], smooth, "#1f77b4", f"train loss (mean of {k})")]  # fmt: skip
    if history.eval_steps:
        left.append(Series(history.eval_steps, history.logloss, "#ff7f0e", "test logloss", dots=True))
    right = (
        [Series(history.eval_steps, history.auc, "#2ca02c", "test AUC", dots=True)]
        if history.eval_steps
        else []
    )
    body = panel(0, left, "logloss") + panel(WIDTH, right, "AUC")
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * WIDTH}" height="{HEIGHT + 30}" '
           f'font-family="sans-serif" font-size="12"><rect width="100%" height="100%" fill="white"/>'
           f'<text x="{WIDTH}" y="18" text-anchor="middle" font-size="14">{escape(title)}</text>'
           f'<g transform="translate(0,30)">{"".join(body)}</g></svg>\n')  # fmt: skip
    path.write_text(svg)
    return path


@dataclass
class Series:
    """One line of a panel: y over x (steps), drawn as a polyline, with dots at the points if asked."""

    x: Sequence[float]
    y: Sequence[float] | np.ndarray
    color: str
    label: str
    dots: bool = False
    opacity: float = 1.0


def panel(left: int, series: list[Series], ylabel: str) -> list[str]:
    """One panel's SVG elements: axes with their min/mid/max ticks, the series, a legend."""
    x0, x1, y0, y1 = left + PAD, left + WIDTH - 20, HEIGHT - PAD + 20, 10  # plot area (y grows down)
    out = [f'<rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}" fill="none" stroke="#444"/>',
           f'<text x="{(x0 + x1) / 2}" y="{HEIGHT - 15}" text-anchor="middle">step</text>',
           f'<text x="{left + 14}" y="{(y0 + y1) / 2}" text-anchor="middle" '
           f'transform="rotate(-90 {left + 14} {(y0 + y1) / 2})">{ylabel}</text>']  # fmt: skip
    points = [(np.asarray(s.x, dtype=np.float64), np.asarray(s.y, dtype=np.float64)) for s in series]
    finite = [(x[np.isfinite(y)], y[np.isfinite(y)]) for x, y in points]
    xs = np.concatenate([x for x, _ in finite]) if finite else np.empty(0)
    ys = np.concatenate([y for _, y in finite]) if finite else np.empty(0)
    if not len(xs):
        return out
    (xa, xb), (ya, yb) = span(xs), span(ys)

    def sx(x: np.ndarray) -> np.ndarray:
        return x0 + (x - xa) / (xb - xa) * (x1 - x0)

    def sy(y: np.ndarray) -> np.ndarray:
        return y0 - (y - ya) / (yb - ya) * (y0 - y1)

    for t in np.linspace(xa, xb, 3):
        out.append(f'<text x="{sx(t):.1f}" y="{y0 + 16}" text-anchor="middle">{t:.4g}</text>')
    for t in np.linspace(ya, yb, 3):
        out.append(f'<text x="{x0 - 4}" y="{sy(t) + 4:.1f}" text-anchor="end">{t:.4g}</text>')
    for i, (s, (x, y)) in enumerate(zip(series, finite, strict=True)):
        px, py = sx(x), sy(y)
        line = " ".join(f"{a:.1f},{b:.1f}" for a, b in zip(px, py, strict=True))
        out.append(f'<polyline points="{line}" fill="none" stroke="{s.color}" stroke-opacity="{s.opacity}"/>')
        if s.dots:
            out += [
                f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3" fill="{s.color}"/>'
                for a, b in zip(px, py, strict=True)
            ]
        ly = y1 + 16 + 16 * i
        out.append(f'<line x1="{x1 - 150}" y1="{ly - 4}" x2="{x1 - 130}" y2="{ly - 4}" stroke="{s.color}" '
                   f'stroke-opacity="{s.opacity}" stroke-width="2"/><text x="{x1 - 125}" y="{ly}">{escape(s.label)}</text>')  # fmt: skip
    return out


def span(v: np.ndarray) -> tuple[float, float]:
    """An axis range holding every value, never empty (a single value gets +-1 around it)."""
    lo, hi = float(v.min()), float(v.max())
    return (lo - 1, hi + 1) if lo == hi else (lo, hi)
