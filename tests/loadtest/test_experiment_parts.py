"""bench-experiment's split p99 figures beside the ratio (loadtest/experiment_parts.py): the A/A of
a side's even rounds against its odd rounds'."""

from __future__ import annotations

import numpy as np

from loadtest.experiment_parts import _halves, _ratio
from loadtest.paced import Responses


def responses(latencies_ms: list[float], status: int = 200) -> Responses:
    n = len(latencies_ms)
    return Responses(np.arange(n, dtype=np.float64), np.array(latencies_ms) / 1e3, np.full(n, status, np.int64),
                     np.full(n, -1, np.int64))  # fmt: skip


def test_halves_pools_the_even_and_the_odd_rounds_apart():
    rounds = [responses([1.0] * 100), responses([2.0] * 100), responses([1.0] * 100), responses([4.0] * 100)]
    got = _halves(rounds)
    assert got == {"p99_ms_even": 1.0, "p99_ms_odd": 4.0, "ratio": 0.25}
    assert _halves(rounds[:1]) == {"p99_ms_even": 1.0, "p99_ms_odd": None, "ratio": None}  # one round: no A/A
    assert (
        _halves([responses([3.0] * 10, status=503), responses([1.0] * 10)])["p99_ms_even"] is None
    )  # failed only


def test_ratio_is_rounded_and_none_without_both_sides():
    assert _ratio(4.116, 3.623) == 1.136 and _ratio(None, 3.0) is None and _ratio(3.0, 0.0) is None
