"""bench-soak's figures: what ``loadtest.bench_soak`` recorded, per window (``analyse``), as
tables and targets (``report``)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np

from loadtest import paced
from loadtest import stream_figures as sf
from loadtest.common import print_table, report_targets
from loadtest.recorder import Responses
from loadtest.series import Series
from loadtest.stream_topics import JOINER_KAFKA_BATCHED, JOINER_MEMBER, TOPICS, USERS_LINGER_MS

NOT_RECSERVE = ("bench", "broker")
"""Processes the RSS check leaves out (``rss_mb`` still shows them): the bench and the mock broker."""


@dataclass(frozen=True)
class Figures:
    """What ``loadtest.stream_figures.event_to_served`` reads, for any window of clicks."""

    samples: sf.SampleLog
    where: np.ndarray
    first: np.ndarray
    codes: np.ndarray
    """Each delta's ``loadtest.published.code``: responses name theirs so across versions."""
    responses: paced.Responses
    clicks: tuple[np.ndarray, np.ndarray]

    def event_to_served(self, a: float, b: float, t0: float = 0.0) -> tuple[dict, int, int]:
        """({p50, p99, over_2s} of the clicks produced in [a, b), clicks, those trained but never
        served). ``over_2s``: when the clicks over 2 s were produced, as spans [from, to, clicks]
        in seconds since ``t0`` (the load's start), so a window's tail can be laid beside its kills,
        full versions and restarts."""
        keys, produced = self.clicks
        m = (produced >= a) & (produced < b)
        t, seconds, unserved = sf.event_to_served((keys[m], produced[m]), self.samples, self.where, self.first,
                                                  self.codes, self.responses)  # fmt: skip
        p = sf.percentiles_s(seconds)
        return (
            {"p50": p["p50"], "p99": p["p99"], "over_2s": spans(t[seconds > 2.0] - t0)},
            int(m.sum()),
            unserved,
        )


def spans(t: np.ndarray, gap_s: float = 2.0) -> list[list[float]]:
    """Sorted times grouped where they lie within ``gap_s`` of each other: [[from, to, count], ...]."""
    t = np.sort(t)
    if not len(t):
        return []
    cuts = np.flatnonzero(np.diff(t) > gap_s) + 1
    return [[round(float(g[0]), 1), round(float(g[-1]), 1), len(g)] for g in np.split(t, cuts)]


def analyse(
    args, t0: float, end: float, responses: list[Responses], figures: Figures, series: Series
) -> dict:
    lean, ts = responses
    width = args.window_min * 60
    windows = []
    n = max(1, round((end - t0) / width))  # the last window ends with the load
    for i in range(n):
        a, b = t0 + i * width, t0 + (i + 1) * width if i < n - 1 else end
        w, wt = lean.window(a, b), ts.window(a, b)
        in_w = [x for x in series.samples if a <= x.t < b]
        names = sorted({n for x in in_w for n in x.rss})
        # a click in the load's last seconds had no response left to see it
        e2s, clicks, unserved = figures.event_to_served(a, min(b, end - 5.0), t0)
        windows.append({
            "minutes": [round((a - t0) / 60, 2), round((b - t0) / 60, 2)],
            "requests": int(len(w.ms)),
            "rps": round(len(w.ms) / (b - a), 1), **ms_percentiles(w),
            "failures": int((w.status != 200).sum() + (wt.status != 200).sum()),
            "mixed_responses": int(w.mixed.sum() + wt.mixed.sum()),
            "torchserve": {"requests": int(len(wt.ms)), **ms_percentiles(wt), "failures": int((wt.status != 200).sum()),
                           "mixed_responses": int(wt.mixed.sum())},
            "event_to_served_s": e2s, "clicks": clicks, "clicks_unserved": unserved,
            "rss_mb": {n: round(float(np.mean([x.rss[n] for x in in_w if n in x.rss])) / 2**20, 1) for n in names},
            "pids": {n: sorted({p for x in in_w for p in x.pids.get(n, ())}) for n in names},
            "cpu_pct": series.cpu_pct(a, b),
            "store_bytes": in_w[-1].disk if in_w else None,
            "version": in_w[-1].current if in_w else None,
        })  # fmt: skip
    return {
        "minutes": round((end - t0) / 60, 2),
        "windows": windows,
        "rss_growth": rss_growth(windows) if windows else {},
        "conditions": {
            "lean": f"recserve serve, co-located lookups, {args.rate:g} rps",
            "torchserve": f"the local stack, 2 PS replicas a shard, remote lookups, {args.ts_rate:g} rps",
            "request_items": args.items,
            "window_s": args.window_s,
            "delta_interval_s": args.delta_interval_s,
            "dedup_window_s": args.dedup_window_s,
            "full_every": args.full_every or None,
            "keep_versions": args.keep_versions,
            "joiner_kafka_config": JOINER_KAFKA_BATCHED.strip().replace("\n", ", "),
            "users_linger_ms": USERS_LINGER_MS,
            "joiner_member": JOINER_MEMBER,
            "trainer_standby": args.standby,
            "drift_weight": args.drift_weight,
            "drift_period_s": args.drift_period_s,
            "click_delay_s": 2.0,
            "partitions": TOPICS,
            "trainer_batch_size": args.batch_size,
            "broker": "librdkafka mock cluster, 3 brokers, one process; everything on this machine",
            "loadavg": os.getloadavg(),
        },  # fmt: skip
    }


def ms_percentiles(r: Responses) -> dict:
    ok = r.ms[r.status == 200]
    if not len(ok):
        return {"p50_ms": None, "p99_ms": None}
    return {
        "p50_ms": round(float(np.percentile(ok, 50)), 2),
        "p99_ms": round(float(np.percentile(ok, 99)), 2),
    }


def rss_growth(windows: list[dict]) -> dict[str, dict]:
    """Per name, the RSS of the process(es) under it at the end, in the windows where they alone
    were (``pids``): their last window's against their first settled one's, the second window for
    one there from the start (the first holds its start-up), the first whole window after its start
    for one that took the name later (a restart, a standby that took over: the window of the kill
    holds both, as a rule). After a kill the name's second window and its last can be two
    processes, a fresh trainer and the standby that took over, not a process and itself. Names
    with a single such window are left out, and those not recserve's (``NOT_RECSERVE``: the bench
    keeps every response it counts, and librdkafka's mock cluster the topics' records; a real
    broker keeps them on disk)."""
    out: dict[str, dict] = {}
    for n, pids in windows[-1]["pids"].items():
        alone = 0
        while alone < len(windows) and windows[-1 - alone]["pids"].get(n) == pids:
            alone += 1
        first = len(windows) - alone + (alone == len(windows))
        if n in NOT_RECSERVE or first >= len(windows) - 1:
            continue
        a, b = windows[first]["rss_mb"][n], windows[-1]["rss_mb"][n]
        out[n] = {"pids": pids, "from_window": first, "from_mb": a, "last_mb": b, "ratio": round(b / a, 3)}
    return out


def report(out: dict, args) -> None:
    rows = [{"window (min)": "-".join(f"{m:g}" for m in w["minutes"]), **{k: w[k] for k in
             ("rps", "p50_ms", "p99_ms", "failures", "mixed_responses", "clicks")},
             "ts_p99_ms": w["torchserve"]["p99_ms"], "e2s_p50_s": w["event_to_served_s"]["p50"],
             "e2s_p99_s": w["event_to_served_s"]["p99"],
             "store_mb": None if w["store_bytes"] is None else round(w["store_bytes"] / 2**20, 1)}
            for w in out["windows"]]  # fmt: skip
    print_table(f"soak: {out['minutes']} minutes, per {args.window_min:g}-minute window", rows, list(rows[0]))
    names = sorted({n for w in out["windows"] for n in w["rss_mb"]})
    print_table("RSS (MB, mean over the window)", [{"process": n, **{f"w{i}": w["rss_mb"].get(n) for i, w in
                enumerate(out["windows"])}} for n in names], ["process", *(f"w{i}" for i in range(len(rows)))])  # fmt: skip
    print_table("CPU (% of one CPU over the window)", [{"process": n, **{f"w{i}": w["cpu_pct"].get(n) for i, w in
                enumerate(out["windows"])}} for n in names], ["process", *(f"w{i}" for i in range(len(rows)))])  # fmt: skip
    print_table("RSS of the processes at the end, by name: their first settled window against the last",
                [{"process": n, **g} for n, g in out["rss_growth"].items()],
                ["process", "pids", "from_window", "from_mb", "last_mb", "ratio"])  # fmt: skip
    print({k: out[k] for k in ("lost_samples", "duplicate_samples", "samples_expected", "samples_trained",
                               "impressions", "impressions_missing", "impressions_unread_by_the_bench",
                               "samples_unread_by_the_bench", "max_samples_dropped_by_the_broker_before_trained",
                               "deltas", "deltas_missed", "kills")})  # fmt: skip
    ws = out["windows"]
    checks = {
        "0 failed responses": sum(w["failures"] for w in ws) == 0,
        "0 mixed responses": sum(w["mixed_responses"] for w in ws) == 0,
        "every answered request in the impression log": out["impressions_missing"] == 0,
        "0 lost samples": out["lost_samples"] == 0,
        "0 duplicate samples": out["duplicate_samples"] == 0,
        "event_to_served_s p99 <= 2 s in every window": all((w["event_to_served_s"]["p99"] or math.inf) <= 2 for w in ws),
    }  # fmt: skip
    if len(ws) >= 3:
        checks["each process's RSS in the last window within 10% of its first settled window's"] = all(
            abs(g["ratio"] - 1) <= 0.1 for g in out["rss_growth"].values())  # fmt: skip
    if len(floors := [f for f in out["store_floor_bytes"] if f[1] is not None]) >= 3:  # two full versions
        checks["the store's bytes under the last full version within 10% of those under the one before"] = (
            floors[-1][1] <= 1.1 * floors[-2][1])  # fmt: skip
    report_targets(out, checks)
