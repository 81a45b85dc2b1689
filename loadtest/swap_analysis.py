"""``loadtest/bench_swap.py``'s figures: a locust timeline (``loadtest.common.TIMELINE_COLUMNS``)
cut into steady and swap windows, p50/p99 of each, one row per event, and the plot.

An event's window runs from its publish until it is live *everywhere a request reads it*: a delta
until every PS shard reports its seq AND the responses show it applied (the first response that
read it ended, and no response started after the publish still read an older seq), so a stall of
the first lookups over a new delta -- in the scoring process's co-located shards, which apply deltas
on their own notice, after the PS shards -- falls inside its window; the full switch until every
shard serves the new version. Behind TorchServe: the dense switch until TorchServe's default is the
new version; the old dense version's retirement until TorchServe no longer lists it (its worker
exits). Behind ``recserve serve``: the frontend's switch until every worker process has answered
from the new version (each one's first such response) and then closed the old one (``drain_s``
later). A request
is *during a swap* when it overlaps any window; *steady* when it started after a 3 s ramp-up,
ended before the full version's publish and overlaps no window nor the second after one: the
quiet stretches before and between the deltas. So the baseline is measured over the same minute as
the deltas, interleaved with them: on a shared machine whose load drifts by the minute, a
baseline taken only before the first delta compared two different machines.

The deltas' windows hold 2 or 3 requests each at 50 requests/s, so their p99 is about the largest
of some 25 latencies, against the steady p99 of thousands. How large that ratio gets with no delta
at all is measured in the same run (``placebo_deltas_ratio``): the same windows, placed at random
in the steady stretches and holding their steady requests only. A ratio above the placebo's p90
is the deltas' doing; one within it is the machine's noise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from loadtest.common import TIMELINE_COLUMNS

RAMP_UP_S = 3.0
GUARD_S = 1.0
"""Requests that start within this long after an event's window are neither steady nor in it."""
FRONTEND_SWITCH = "frontend version switch"
SWITCHES = ("dense version switch", FRONTEND_SWITCH)
"""The event after which every response reads the new version (TorchServe's, recserve serve's)."""
PLACEBO_DRAWS = 500


class Timeline:
    """A locust timeline's columns by name (``end_time``, ``ms``, ...), plus each request's start."""

    def __init__(self, tl: np.ndarray):
        self.cols = {name: tl[:, i] for i, name in enumerate(TIMELINE_COLUMNS)}
        self.end, self.ms = self.cols["end_time"], self.cols["ms"]
        self.start = self.end - self.ms / 1e3
        self.failed = self.cols["failed"].astype(bool)
        self.seq = self.cols["delta_seq"]
        self.dense = self.cols["dense_version"]
        self.pid = self.cols["pid"]

    def figures(self, mask: np.ndarray) -> dict:
        """requests, p50/p99/max latency (ms) of the requests in ``mask`` and the p99/max of
        their handler stages (Server-Timing: ``server_ms`` the whole request in the handler,
        ``worker_ms`` its lookup, ``dense_ms`` its dense run)."""
        out: dict = {"requests": int(mask.sum())}
        ms = self.ms[mask]
        out |= {f"p{q}_ms": _pct(ms, q) for q in (50, 99)} | {"max_ms": _round(ms.max()) if len(ms) else None}
        for stage in ("server_ms", "worker_ms", "dense_ms"):
            v = self.cols[stage][mask]
            v = v[v >= 0]
            out[f"{stage[:-3]}_p99_ms"] = _pct(v, 99)
            out[f"{stage[:-3]}_max_ms"] = _round(v.max()) if len(v) else None
        return out


def delta_applied(t: Timeline, e: dict, before: float, of: np.ndarray | None = None) -> float:
    """When delta ``e`` was live in the responses (``of``: those of one process): the first
    response that read it ended, and no response started after its publish (and before
    ``before``, the next version) read an older seq any more. Raises when no response read it."""
    after = (t.end >= e["start"]) & (t.start < before) & ~t.failed & (True if of is None else of)
    seen = t.end[after & (t.seq >= e["seq"])]
    if not len(seen):
        raise RuntimeError(f"no response read delta {e['seq']}")
    stale = t.end[after & (t.start >= e["start"]) & (t.seq >= 0) & (t.seq < e["seq"])]
    return float(max(seen.min(), stale.max() if len(stale) else 0.0))


def switched(t: Timeline, e: dict) -> dict[int, float]:
    """Per process (pid), when it answered from ``e``'s version: the end of its first response that
    started after the publish and read it. Raises when a process that answered after the publish
    never read it (it did not switch)."""
    after = (t.start >= e["start"]) & ~t.failed
    out = {}
    for pid in np.unique(t.pid[after]):
        new = after & (t.pid == pid) & (t.dense == int(e["version"]))
        if not new.any():
            raise RuntimeError(f"process {int(pid)} never answered from version {e['version']}")
        out[int(pid)] = float(t.end[new].min())
    return out


def analyse(tl: np.ndarray, events: list[dict], t_start: float) -> dict:
    """The figures of one run (one lookup mode, one serving dtype): steady against during swaps,
    each event's window, and when each delta became visible. ``events`` (from the swap schedule:
    kind, start, live, a delta's seq; the frontend's switch: its version and ``drain_s``) gain
    ``applied`` (deltas; the frontend's switch: its last process's first response from the new
    version) and ``end`` (their window's end)."""
    t = Timeline(tl)
    full = next(e for e in events if e["kind"] != "delta")  # the new version's publish
    for e in events:
        e["end"] = e["live"]
        if e["kind"] == "delta":
            e["applied"] = delta_applied(t, e, full["start"])
            e["end"] = max(e["live"], e["applied"])
        elif e["kind"] == FRONTEND_SWITCH:
            e["applied"] = max(switched(t, e).values())
            e["end"] = max(e["live"], e["applied"] + e["drain_s"] + GUARD_S)  # the old scorers closed
    dense_live = next(e for e in events if e["kind"] in SWITCHES)["end"]
    near = np.zeros(len(t.ms), bool)
    for e in events:
        near |= (t.end >= e["start"]) & (t.start <= e["end"] + GUARD_S)
    steady = (t.start >= t_start + RAMP_UP_S) & (t.end < full["start"]) & ~near
    in_swap = np.zeros(len(t.ms), bool)
    in_deltas = np.zeros(len(t.ms), bool)
    rows = []
    for e in events:
        window = (t.end >= e["start"]) & (t.start <= e["end"])
        in_swap |= window
        if e["kind"] == "delta":
            in_deltas |= window
        name = f"delta {e['seq']}" if e["kind"] == "delta" else e["kind"]
        rows.append({"event": name, "window_s": round(e["end"] - e["start"], 3), **t.figures(window)})
    in_full = (t.end >= full["start"]) & (t.start <= dense_live)
    s, w, d = t.figures(steady), t.figures(in_swap), t.figures(in_deltas)
    deltas = [e for e in events if e["kind"] == "delta"]
    placebo = placebo_deltas_ratio(t, steady, [e["end"] - e["start"] for e in deltas],
                                   (t_start + RAMP_UP_S, full["start"]), s["p99_ms"])  # fmt: skip
    visible = [e["applied"] - e["start"] for e in deltas]
    ps_live = [e["live"] - e["start"] for e in deltas]
    per_process = {str(int(pid)): _process(t, t.pid == pid, steady, in_swap, deltas, full["start"])
                   for pid in np.unique(t.pid[~t.failed])}  # fmt: skip
    return {
        "requests": int(len(t.ms)),
        "failures": int(t.failed.sum()),
        "mixed_responses": int(t.cols["mixed"].astype(bool).sum()),
        "responses_by_dense_version": {
            str(int(v)): int((t.cols["dense_version"] == v).sum())
            for v in np.unique(t.cols["dense_version"])
            if v >= 0
        },
        "p50_steady_ms": s["p50_ms"],
        "p99_steady_ms": s["p99_ms"],
        "steady_requests": s["requests"],
        "p50_during_swap_ms": w["p50_ms"],
        "p99_during_swap_ms": w["p99_ms"],
        "swap_requests": w["requests"],
        "p99_ratio": _ratio(w["p99_ms"], s["p99_ms"]),
        "p99_during_deltas_ms": d["p99_ms"],
        "p99_deltas_ratio": _ratio(d["p99_ms"], s["p99_ms"]),
        "placebo_deltas_ratio": placebo,
        "first_delta_p99_ms": rows[0]["p99_ms"],
        "full_switch_window_s": round(dense_live - full["start"], 3),
        "full_switch_p99_ms": t.figures(in_full)["p99_ms"],
        "delta_visible_p50_s": _pct(np.asarray(visible), 50),
        "delta_visible_p99_s": _pct(np.asarray(visible), 99),
        "delta_ps_live_p99_s": _pct(np.asarray(ps_live), 99),
        "stages": {"steady": _stages(s), "during_swap": _stages(w)},
        "per_event": rows,
        "per_process": per_process,
        "events": [_relative(e, t_start) for e in events],
    }


def _process(t: Timeline, of: np.ndarray, steady: np.ndarray, in_swap: np.ndarray, deltas: list[dict],
             before: float) -> dict:  # fmt: skip
    """One scoring process's figures (the responses ``of`` it: its X-Recserve-Pid): requests,
    failures, mixed responses, p99 steady and during swaps, and when it read each delta."""
    s, w = t.figures(steady & of), t.figures(in_swap & of)
    visible = [delta_applied(t, e, before, of) - e["start"] for e in deltas]
    return {
        "requests": int(of.sum()),
        "failures": int((t.failed & of).sum()),
        "mixed_responses": int(t.cols["mixed"][of].astype(bool).sum()),
        "p99_steady_ms": s["p99_ms"],
        "p99_during_swap_ms": w["p99_ms"],
        "p99_ratio": _ratio(w["p99_ms"], s["p99_ms"]),
        "delta_visible_p99_s": _pct(np.asarray(visible), 99),
    }


def placebo_deltas_ratio(t: Timeline, steady: np.ndarray, lengths: list[float], span: tuple[float, float],
                         p99_steady: float | None, seed: int = 0) -> dict | None:  # fmt: skip
    """The deltas' p99 ratio where no delta is: windows of the deltas' ``lengths`` placed at random
    in ``span`` (the steady stretch), each holding the steady requests it overlaps, their p99
    against the steady p99, ``PLACEBO_DRAWS`` times. {p50, p90} of those ratios (None without a
    steady p99 or a span to place them in)."""
    lo, hi = span
    if not p99_steady or not lengths or hi - lo <= max(lengths):
        return None
    rng = np.random.default_rng(seed)
    start, end, ms = t.start[steady], t.end[steady], t.ms[steady]
    ratios = []
    for _ in range(PLACEBO_DRAWS):
        at = rng.uniform(lo, hi - np.asarray(lengths))
        inside = ((end[:, None] >= at) & (start[:, None] <= at + lengths)).any(axis=1)
        if inside.any():
            ratios.append(float(np.percentile(ms[inside], 99)) / p99_steady)
    if not ratios:
        return None
    return {
        "p50": _round(np.percentile(ratios, 50)),
        "p90": _round(np.percentile(ratios, 90)),
        "draws": len(ratios),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _relative(e: dict, t_start: float) -> dict:
    """An event with its times in seconds since the load started."""
    return {k: round(v - t_start, 3) if k in ("start", "live", "applied", "end") else v for k, v in e.items()}


def _stages(f: dict) -> dict:
    return {k: v for k, v in f.items() if k.startswith(("server_", "worker_", "dense_"))}


def _pct(v: np.ndarray, q: float) -> float | None:
    return _round(np.percentile(v, q)) if len(v) else None


def _round(x) -> float:
    return round(float(x), 3)


def plot(tl: np.ndarray, t_start: float, events: list[dict], path: Path, title: str) -> None:
    """Latency over time (log scale) with each event's window (publish -> live everywhere)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = Timeline(tl)
    x = t.start - t_start
    fig, ax = plt.subplots(figsize=(12, 5))
    ax.scatter(x[~t.failed], t.ms[~t.failed], s=4, color="tab:blue", label="request latency")
    if t.failed.any():
        ax.scatter(x[t.failed], t.ms[t.failed], s=12, color="red", marker="x", label="failed")
    colors = {"delta": "tab:green", "full version switch": "tab:orange", "dense version switch": "tab:purple",
              "old dense version retired": "tab:gray", FRONTEND_SWITCH: "tab:purple"}  # fmt: skip
    seen = set()
    for e in events:
        c = colors[e["kind"]]
        label = None if e["kind"] in seen else f"{e['kind']} (publish -> live)"
        ax.axvspan(e["start"], e["end"], color=c, alpha=0.25, label=label)
        ax.axvline(e["start"], color=c, lw=0.8)
        seen.add(e["kind"])
    ax.set_xlabel("seconds since load start")
    ax.set_ylabel("latency (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
