"""Replays of logged samples through the sequential rule, to measure how often it errs.

A replay splits units between a control and a candidate arm by a salted stable hash (a unit always
lands in one arm: XXH64 of the unit's string with the salt as seed, or splitmix64 of a uint64 unit
key xor the mixed salt), then feeds the samples in arrival order, ``chunk`` at a time, to
``stream.sequential.decide`` as a live metrics role would, and stops at the first decision.

In an A/A replay both arms serve the same scores, so every decision (promote or abort) is false;
``aa_replays`` counts them over replays with salts 0..N-1. ``replay`` also takes a different
candidate score per sample, to measure the rule's power and the samples it takes to decide.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from features.hashing import mix64, xxh64_strings
from stream.arms import ArmSums, check_scores
from stream.sequential import Decision, SequentialConfig, Verdict, decide

CHUNK = 1000
"""Samples between two looks of the rule (a metrics role reading the samples topic in batches)."""


def in_candidate(units: ArrayLike, salt: int, share: float = 0.5) -> NDArray[np.bool_]:
    """Whether each unit's samples go to the candidate arm (``share`` of units), stably per salt."""
    u = np.asarray(units).ravel()
    if u.dtype.kind == "u":
        h = mix64(u.astype(np.uint64) ^ mix64(np.array([salt], np.uint64)))
    elif u.dtype.kind in "US":
        h = xxh64_strings(u.astype(np.str_), seed=salt)
    else:
        raise ValueError(f"unit keys must be strings or unsigned integers, got dtype {u.dtype}")
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53 < share


@dataclass(frozen=True)
class ReplayResult:
    """One replay: the last decision (the first that was not ``continue``, or the last look's)."""

    decision: Decision
    samples: int
    """Samples fed (both arms) when the rule decided, or all of them."""


def replay(
    candidate: NDArray[np.bool_],
    control_score: NDArray[np.float64],
    candidate_score: NDArray[np.float64],
    label: NDArray[np.float64],
    config: SequentialConfig | None = None,
    chunk: int = CHUNK,
) -> ReplayResult:
    """Feed the samples, ``chunk`` at a time, each scored by its arm's score; stop at a decision."""
    n = len(label)
    if not len(candidate) == len(control_score) == len(candidate_score) == n:
        raise ValueError("candidate mask, both scores and labels must have one length")
    if chunk < 1:
        raise ValueError(f"chunk must be positive, got {chunk}")
    check_scores(control_score, label)
    check_scores(candidate_score, label)
    ctrl, cand = ArmSums(), ArmSums()
    decision = decide(ctrl, cand, config)
    for start in range(0, n, chunk):  # a loop per chunk, each chunk vectorised
        sl = slice(start, start + chunk)
        mine, y = candidate[sl], label[sl]
        ctrl = ctrl + ArmSums.of(control_score[sl][~mine], y[~mine])
        cand = cand + ArmSums.of(candidate_score[sl][mine], y[mine])
        decision = decide(ctrl, cand, config)
        if decision.verdict is not Verdict.CONTINUE:
            return ReplayResult(decision, min(start + chunk, n))
    return ReplayResult(decision, n)


@dataclass(frozen=True)
class AAResult:
    replays: int
    false_promotions: int
    false_aborts: int
    false_decision_rate: float
    samples: int
    """Samples in each replay."""
    alpha: float
    samples_to_false_decision: list[int]
    """For each false decision, the samples it took."""


def aa_replays(
    units: ArrayLike,
    score: ArrayLike,
    label: ArrayLike,
    replays: int,
    config: SequentialConfig | None = None,
    chunk: int = CHUNK,
    first_salt: int = 0,
) -> AAResult:
    """A/A replays of logged samples (unit key, served score, label; arrival order), salts
    ``first_salt``.. ``first_salt + replays - 1``: how many ended in a (false) decision."""
    s = np.asarray(score, dtype=np.float64).ravel()
    y = np.asarray(label, dtype=np.float64).ravel()
    u = np.asarray(units).ravel()
    if not len(u) == len(s) == len(y):
        raise ValueError(f"arrays of different lengths: units {len(u)}, score {len(s)}, label {len(y)}")
    if replays < 1:
        raise ValueError(f"replays must be positive, got {replays}")
    cfg = config or SequentialConfig()
    results = [
        replay(in_candidate(u, salt), s, s, y, cfg, chunk) for salt in range(first_salt, first_salt + replays)
    ]
    verdicts = [r.decision.verdict for r in results]
    promotions, aborts = verdicts.count(Verdict.PROMOTE), verdicts.count(Verdict.ABORT)
    return AAResult(
        replays,
        promotions,
        aborts,
        (promotions + aborts) / replays,
        len(y),
        cfg.alpha,
        [r.samples for r in results if r.decision.verdict is not Verdict.CONTINUE],
    )
