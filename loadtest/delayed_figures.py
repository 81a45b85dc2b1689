"""The figures of ``make bench-delayed`` from what a run leaves: the world's draws (every impression
the users read, its served scores, the clicks drawn for it and their delays, sent or not yet:
``Drawn``), the clicks sent (``stream_figures.Clicks``) and the samples topic as read. Plain
functions over numpy arrays, no Kafka.

**Final labels** are the world's, not the joiner's: an item of an impression is a click when the
users drew a click for it whose delay is within the attribution window, whether or not it was sent
or joined before the run ended. Every arm is judged against them, so an arm that never hears of a
late click is judged on it all the same.

**Keys** are the trainer's: (item, request) with the item's top bit set for a correction
(``stream.sample_batch.KIND_BIT``): a click whose delay is past the first horizon
(``--label-after-s``) reaches the trainer as a correction when the joiner corrects
(``--attribution-s``), else not at all (drop-late) or as the one label (a horizon as long as the
attribution window).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from loadtest.stream_figures import keys_of, percentiles_s
from stream.records import Event, Impression
from stream.sample_batch import KIND_BIT
from training.evaluate import auc_logloss
from training.follow.delayed import settles_at

SETTLE_TOLERANCE = 0.02
"""An arm's calibration has settled when its measured span's is within 2% of the span's before it."""


@dataclass(frozen=True)
class World:
    """The world's draws, one row per impression (``scores``: one column per item) and one per
    click drawn."""

    request_ids: NDArray[np.bytes_]
    ts: NDArray[np.float64]
    scores: NDArray[np.float32]
    click_keys: NDArray[np.bytes_]
    click_delays: NDArray[np.float64]


class Drawn:
    """``play``'s ``on_drawn``: every impression read and the clicks drawn for it."""

    def __init__(self) -> None:
        self.impressions: list[tuple[str, float, NDArray[np.float32]]] = []
        self.clicks: list[tuple[str, list[Event], float]] = []
        self.lock = threading.Lock()

    def __call__(self, imp: Impression, clicks: list[Event]) -> None:
        with self.lock:
            self.impressions.append((imp.request_id, imp.ts, np.asarray(imp.scores, np.float32)))
            if clicks:
                self.clicks.append((imp.request_id, clicks, imp.ts))

    def __len__(self) -> int:
        return len(self.impressions)

    def world(self) -> World:
        with self.lock:
            imps, clicks = list(self.impressions), list(self.clicks)
        if len({len(s) for _, _, s in imps}) > 1:
            raise ValueError("impressions of different sizes: the world's labels need one set of items")
        rid = np.array([r.encode() for r, _, _ in imps]) if imps else np.zeros(0, "S1")
        n = [len(es) for _, es, _ in clicks]
        crid = np.repeat(np.array([r.encode() for r, _, _ in clicks]) if clicks else np.zeros(0, "S1"), n)
        items = np.fromiter((e.item for _, es, _ in clicks for e in es), np.int64, sum(n))
        delays = np.fromiter((e.ts for _, es, _ in clicks for e in es), np.float64, sum(n))
        delays -= np.repeat(np.array([t for _, _, t in clicks], np.float64), n)
        scores = np.stack([s for _, _, s in imps]) if imps else np.zeros((0, 0), np.float32)
        return World(rid, np.array([t for _, t, _ in imps], np.float64), scores, keys_of(crid, items), delays)


def _bytes(keys: NDArray[np.bytes_]) -> NDArray[np.uint8]:
    """(keys, width) bytes of fixed-width keys."""
    return np.frombuffer(np.ascontiguousarray(keys).tobytes(), np.uint8).reshape(
        len(keys), keys.dtype.itemsize
    )


def with_kind(keys: NDArray[np.bytes_], correction: NDArray[np.bool_]) -> NDArray[np.bytes_]:
    """``keys`` with the correction bit set where ``correction`` (the top bit of the item word)."""
    raw = _bytes(keys).copy()
    raw[:, 0] |= np.where(correction, np.uint8(KIND_BIT >> 24), np.uint8(0))
    return np.ascontiguousarray(raw).view(keys.dtype).ravel()


def final_labels(world: World, attribution_s: float) -> NDArray[np.float32]:
    """(impressions, items): 1 where the world drew a click within ``attribution_s`` of the
    impression, else 0."""
    n, items = world.scores.shape
    keys = keys_of(np.repeat(world.request_ids, items), np.tile(np.arange(items), n))
    clicked = world.click_keys[world.click_delays <= attribution_s]
    width = max(keys.dtype.itemsize, clicked.dtype.itemsize)
    return np.isin(keys.astype(f"S{width}"), clicked.astype(f"S{width}")).astype(np.float32).reshape(n, items)


def quality(scores: NDArray[np.floating], labels: NDArray[np.floating]) -> dict:
    """Served scores against final labels: AUC, log loss, calibration (mean predicted / observed
    CTR) and both CTRs."""
    s, y = np.asarray(scores, np.float64).ravel(), np.asarray(labels, np.float64).ravel()
    if not len(y) or not 0 < y.sum() < len(y):
        return {"auc": None, "logloss": None, "calibration": None, "predicted_ctr": None, "observed_ctr": None,
                "n": len(y)}  # fmt: skip
    auc, logloss = auc_logloss(y, np.clip(s, 1e-7, 1 - 1e-7))
    return {"auc": round(float(auc), 4), "logloss": round(float(logloss), 4),
            "calibration": round(float(s.mean() / y.mean()), 4), "predicted_ctr": round(float(s.mean()), 4),
            "observed_ctr": round(float(y.mean()), 4), "n": len(y)}  # fmt: skip


def served_quality(world: World, attribution_s: float, start: float, end: float,
                   frozen: NDArray[np.float32]) -> dict:  # fmt: skip
    """``quality`` of the impressions served in [``start``, ``end``), and the frozen model's AUC
    on them (``frozen``: its scores of the items, the start's version)."""
    m = (world.ts >= start) & (world.ts < end)
    labels = final_labels(world, attribution_s)[m]
    out = quality(world.scores[m], labels)
    out["frozen_auc"] = quality(np.broadcast_to(frozen, labels.shape), labels)["auc"]
    return out


def calibration_every(world: World, attribution_s: float, start: float, end: float, every_s: float) -> list:
    """The served calibration of each ``every_s`` of impressions from ``start`` (None: no click)."""
    labels = final_labels(world, attribution_s)
    bucket = np.floor((world.ts - start) / every_s).astype(np.int64)
    n = int(np.ceil((end - start) / every_s))
    ok = (bucket >= 0) & (bucket < n)
    pred = np.bincount(bucket[ok], world.scores[ok].sum(axis=1), n)
    seen = np.bincount(bucket[ok], labels[ok].sum(axis=1), n)
    return [round(float(p / s), 3) if s else None for p, s in zip(pred, seen, strict=True)]


def fixed_point(p: NDArray[np.floating], delays: NDArray[np.float64], label_after_s: float, attribution_s: float,
                mode: str, correcting: bool) -> float | None:  # fmt: skip
    """The calibration an arm's loss settles at in this world (``delayed.settles_at``): ``p`` the
    world's final click probabilities of the items measured (any shape), ``delays`` the clicks'
    (the share of those within ``attribution_s`` that came within ``label_after_s`` is ``q``):
    the predictions it settles at summed over the world's. ``fnw`` with corrections: ``p / (1 - p
    q)`` per item, above 1 by more where clicks are common; ``esdfm`` and waiting for all: 1;
    drop-late (``none``, no corrections): ``q``."""
    final = delays[delays <= attribution_s]
    total = float(np.sum(p))
    if not len(final) or not total:
        return None
    q = float(np.mean(final <= label_after_s))
    return round(float(settles_at(mode, p, q, correcting).sum()) / total, 4)


def settled(before: float | None, measured: float | None, tolerance: float = SETTLE_TOLERANCE) -> dict:
    """Whether an arm's calibration had settled: the measured span's against the span as long
    before it; settled when they differ by at most ``tolerance`` (relative)."""
    change = round(measured / before - 1, 4) if before and measured is not None else None
    return {"calibration_before": before, "calibration_measured": measured, "change": change,
            "settled": change is not None and abs(change) <= tolerance}  # fmt: skip


@dataclass(frozen=True)
class SentClicks:
    """The clicks sent, as the trainer keys the sample each one makes (``keys``), their delays and
    produce times."""

    keys: NDArray[np.bytes_]
    delays: NDArray[np.float64]
    sent: NDArray[np.float64]


def sent_clicks(sent: tuple[NDArray[np.bytes_], NDArray[np.float64]], world: World, label_after_s: float,
                correcting: bool) -> SentClicks:  # fmt: skip
    """The clicks sent (``Clicks.arrays()``: their (item, request) keys, produce times), each with
    its delay (looked up in ``world``) and, when the joiner ``correcting``, the correction bit set
    on those past ``label_after_s``."""
    keys, t = sent
    width = max(keys.dtype.itemsize, world.click_keys.dtype.itemsize, 1)
    drawn = world.click_keys.astype(f"S{width}")
    order = np.argsort(drawn, kind="stable")
    at = np.searchsorted(drawn[order], keys.astype(f"S{width}")).clip(max=max(len(drawn) - 1, 0))
    if len(keys) and (not len(drawn) or (drawn[order][at] != keys.astype(f"S{width}")).any()):
        raise ValueError("a click was sent that the world never drew")
    delays = world.click_delays[order][at] if len(keys) else np.zeros(0)
    late = delays > label_after_s if correcting else np.zeros(len(keys), bool)
    return SentClicks(with_kind(keys.astype(f"S{width}"), late), delays, t)


def expected_corrections(clicks: SentClicks, label_after_s: float, attribution_s: float,
                         margin_s: float = 1.0) -> NDArray[np.bytes_]:  # fmt: skip
    """The correction keys the joiner owes: of the clicks sent, those past ``label_after_s`` and
    ``margin_s`` inside the attribution window (one at its very end may find the window closed,
    the joiner's clock a little ahead of its ts)."""
    m = (clicks.delays > label_after_s) & (clicks.delays <= attribution_s - margin_s)
    return clicks.keys[m]


def is_correction(keys: NDArray[np.bytes_]) -> NDArray[np.bool_]:
    """Per key: whether it is a correction's (its item word's top bit)."""
    return (_bytes(keys)[:, 0] & np.uint8(KIND_BIT >> 24)) > 0 if len(keys) else np.zeros(0, bool)


def rss_mb(samples: list[tuple[float, int]], start: float) -> dict:
    """A process's RSS (MB) sampled as (time.time(), bytes): the most in the load's second minute
    (from ``start``; a long window's state fills in its first), the last sample and the most."""
    t = np.array([s for s, _ in samples], np.float64)
    b = np.array([r for _, r in samples], np.float64) / 2**20
    second = b[(t >= start + 60) & (t < start + 120)]
    return {"second_minute": round(float(second.max()), 1) if len(second) else None,
            "last": round(float(b[-1]), 1) if len(b) else None, "max": round(float(b.max(initial=0)), 1)}  # fmt: skip


def served_wait(t_click: NDArray[np.float64], seconds: NDArray[np.float64], start: float, end: float) -> dict:
    """event -> served over the clicks produced from ``start`` to 5 s before ``end`` (the load's)."""
    m = (t_click >= start) & (t_click < end - 5.0)
    return percentiles_s(seconds[m])
