import numpy as np
import pytest

from loadtest.common import TIMELINE_COLUMNS
from loadtest.swap_analysis import analyse


def _timeline(rows: list[tuple]) -> np.ndarray:
    """(end, ms, delta seq, worker ms) per request; the other columns as a scored response's."""
    tl = np.zeros((len(rows), len(TIMELINE_COLUMNS)))
    col = TIMELINE_COLUMNS.index
    for i, (end, ms, seq, worker) in enumerate(rows):
        tl[i, [col("end_time"), col("ms"), col("delta_seq"), col("worker_ms")]] = end, ms, seq, worker
        tl[i, [col("dense_version"), col("server_ms"), col("dense_ms")]] = 1, worker + 1, 1
    return tl


def test_a_delta_window_lasts_until_the_responses_read_it_and_its_stall_counts():
    # steady 5 ms requests; delta 0 published at 10.0, every PS shard live at 10.1, but the
    # scorer's own shards applied it later: a request that started at 10.2 still read seq -1,
    # and the first one that read it (at 10.6) stalled 300 ms in its lookup
    steady = [(4.0 + 0.1 * k, 5.0, -1, 1.0) for k in range(50)]
    around = [(10.205, 5.0, -1, 1.0), (10.6, 300.0, 0, 295.0), (10.62, 250.0, 0, 1.0), (11.0, 5.0, 0, 1.0)]
    after = [(20.0 + 0.1 * k, 5.0, 0, 1.0) for k in range(30)]
    events = [
        {"kind": "delta", "seq": 0, "start": 10.0, "live": 10.1},
        {"kind": "full version switch", "start": 22.0, "live": 22.2},
        {"kind": "dense version switch", "start": 22.2, "live": 22.5},
    ]
    result = analyse(_timeline(steady + around + after), events, t_start=0.0)
    delta = result["events"][0]
    assert delta["applied"] == 10.6 and delta["end"] == 10.6  # not the PS shards' 10.1
    row = result["per_event"][0]
    assert row["event"] == "delta 0" and row["requests"] == 3 and row["max_ms"] == 300.0
    assert row["worker_max_ms"] == 295.0  # the stall was in the lookup, not outside the handler
    assert result["first_delta_p99_ms"] > 200 and result["p99_steady_ms"] == 5.0
    assert result["p99_ratio"] > 1.5
    assert result["delta_visible_p50_s"] == 0.6 and result["delta_ps_live_p99_s"] == 0.1
    # steady: the quiet stretches before and between events (not the second after a window)
    assert result["steady_requests"] == 50 + 20  # before; after the delta, up to the full switch


def test_the_deltas_ratio_comes_with_the_same_windows_where_no_delta_is():
    # a request every 20 ms, 5 ms each, one in 40 at 9 ms (the steady p99); three deltas whose
    # windows (50 ms) each stalled a request to 30 ms: the deltas' ratio is theirs, while the same
    # windows placed in the steady stretches come out at most 1
    steady = [(3.0 + 0.02 * k, 9.0 if k % 40 == 0 else 5.0, -1, 1.0) for k in range(900)]
    stalls, events = [], []
    for seq, at in enumerate((8.003, 12.003, 16.003)):
        stalls.append((at + 0.04, 30.0, seq, 1.0))
        events.append({"kind": "delta", "seq": seq, "start": at, "live": at + 0.04})
    timeline = [r for r in steady if not any(e["start"] - 0.01 <= r[0] <= e["start"] + 0.05 for e in events)]
    after = [(22.0 + 0.1 * k, 5.0, 2, 1.0) for k in range(10)]
    events += [{"kind": "full version switch", "start": 21.0, "live": 21.2},
               {"kind": "dense version switch", "start": 21.2, "live": 21.5}]  # fmt: skip
    result = analyse(_timeline(sorted(timeline + stalls) + after), events, t_start=0.0)
    placebo = result["placebo_deltas_ratio"]
    assert result["p99_steady_ms"] == 9.0 and result["p99_deltas_ratio"] > 3
    assert placebo["draws"] > 400 and placebo["p50"] <= placebo["p90"] <= 1.0


def _two_workers(switch_at: dict[int, float]) -> np.ndarray:
    """Workers 101 and 102 answering 5 ms requests every 0.1 s each from 3 s to 20 s, version 1
    until their switch to version 2 at ``switch_at[pid]``."""
    tl = _timeline(
        [(3.0 + 0.1 * k + 0.05 * (pid - 101), 5.0, -1, 1.0) for k in range(170) for pid in (101, 102)]
    )
    col = TIMELINE_COLUMNS.index
    tl[:, col("pid")] = np.tile([101, 102], 170)
    for pid, at in switch_at.items():
        tl[(tl[:, col("pid")] == pid) & (tl[:, col("end_time")] > at), col("dense_version")] = 2
    return tl


def test_the_frontends_switch_lasts_until_its_last_worker_answers_from_the_new_version_and_drains():
    events = [
        {"kind": "frontend version switch", "version": "2", "start": 10.0, "live": 11.5, "drain_s": 2.0}
    ]
    result = analyse(_two_workers({101: 10.3, 102: 10.8}), events, t_start=0.0)
    (switch,) = result["events"]
    # worker 102's first response from version 2 ended at 10.85; its old scorer closes 2 s later
    assert switch["applied"] == 10.85 and switch["end"] == 10.85 + 2.0 + 1.0
    assert result["full_switch_window_s"] == 3.85 and result["mixed_responses"] == 0
    workers = result["per_process"]
    assert set(workers) == {"101", "102"} and all(w["requests"] == 170 for w in workers.values())
    assert workers["101"]["p99_steady_ms"] == 5.0 and workers["101"]["p99_ratio"] == 1.0


def test_a_worker_that_never_answers_from_the_new_version_fails_the_run():
    events = [
        {"kind": "frontend version switch", "version": "2", "start": 10.0, "live": 11.5, "drain_s": 2.0}
    ]
    with pytest.raises(RuntimeError, match="process 102 never answered from version 2"):
        analyse(_two_workers({101: 10.3}), events, t_start=0.0)
