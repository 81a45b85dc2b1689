"""Samples of an experiment's arms for the watcher's tests: a store with three versions of model m
(version 1 published) and an experiment on it, and sample records with the served scores, labels
and arms the test chooses, with the arrays a recomputation reads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

import model_store as ms
from model_store import experiments as ex
from stream.arms import Samples
from stream.records import SampleWriter
from stream.rows import RowTable
from tests.model_store.helpers import write_version
from tests.serving.helpers import ranking_batch
from tests.stream.helpers import N_ITEMS, impression_record

ROWS = RowTable.of(ranking_batch())


def experiment_store(root) -> ex.Experiment:
    """Model m with versions 1 (CURRENT), 2 and 3, and experiment "t": control v1, A v2, B v3 (10% each)."""
    for _ in range(3):
        write_version(root)
    ms.publish(root, "m", "1")
    return ex.start(root, "m", "t", [("2", 0.1), ("3", 0.1)])


@dataclass
class Produced:
    """Sample records and, for those of the experiment, the arrays they carry."""

    records: list[tuple[str, bytes]]
    arm: list[str]
    score: list[float]
    label: list[float]
    ts: list[float]
    request: list[str]

    def samples(self) -> Samples:
        """The experiment's samples as ``stream.arms`` reads them (scores as the records hold them)."""
        score = np.asarray(self.score, np.float32).astype(np.float64)
        return Samples.of(np.asarray(self.arm), score, self.label, self.ts, np.asarray(self.request))


def impressions(
    arm: str, n: int, start: float, rng: np.random.Generator, scorer, prefix: str = ""
) -> Produced:
    """``n`` requests of ``N_ITEMS`` items served by ``arm``, scored from ``start`` on (0.05 s
    apart): each item's true click rate p in [0.05, 0.5], its label drawn from it, its served score
    ``scorer(p, rng)``."""
    out = Produced([], [], [], [], [], [])
    for i in range(n):
        rid = f"{prefix}{arm or 'none'}-{i}"
        p = rng.uniform(0.05, 0.5, N_ITEMS)
        score = np.clip(scorer(p, rng), 0.001, 0.999).astype(np.float32)
        label = (rng.random(N_ITEMS) < p).astype(np.float64)
        ts = start + 0.05 * i
        imp = dataclasses.replace(impression_record(rid, ts), scores=score, arm=arm)
        writer = SampleWriter(imp, ROWS)
        for item in range(N_ITEMS):
            out.records.append((rid, writer.encode(item, float(label[item]))))
        out.arm += [arm] * N_ITEMS
        out.score += score.tolist()
        out.label += label.tolist()
        out.ts += [ts] * N_ITEMS
        out.request += [rid] * N_ITEMS
    return out


def mixed(parts: list[Produced], rng: np.random.Generator) -> list[tuple[str, bytes]]:
    """Every part's records in one random order (arms interleave as in a live topic)."""
    records = [r for p in parts for r in p.records]
    return [records[i] for i in rng.permutation(len(records))]


def concat(parts: list[Produced]) -> Produced:
    out = Produced([], [], [], [], [], [])
    for p in parts:
        for f in dataclasses.fields(Produced):
            getattr(out, f.name).extend(getattr(p, f.name))
    return out


def truthful(p, rng):
    return p


def noisy(p, rng):
    return p + rng.normal(0, 0.2, len(p))


def inverted(p, rng):
    return 1 - p
