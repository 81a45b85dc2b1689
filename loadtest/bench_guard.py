"""``make bench-guard``: the learning loop's guards, tried as an operator would meet them.

    python -m loadtest.bench_guard [--rate 10] [--quick] [--results-dir DIR] [--store DIR]

The whole loop on the mock Kafka cluster (``loadtest.mockbroker``), in a drifting world (each
item's taste goes round every ``--drift-period-s``, 600 s: slower than ``make bench-stream``'s
60 s, whose 10 s join window it outpaces no more than this bench's 30 s one does this one): ``recserve serve`` (co-located lookups, ``--log-impressions``) loaded at
``--rate`` requests/s of 200 items, simulated users clicking, ``recserve join`` (its input guard
on, ``--record-to`` the model) and ``recserve train --follow --stream`` (its output guard on),
every guard at its documented defaults. The phases, each ``--phase-s`` long unless named:

1. ``warm`` (``--warm-s``, 120 s): healthy; the guards form their bands. The users click about a
   quarter of the items (``--ctr``, Criteo's rate), which the served model starts calibrated to.
2. ``late``: the click pipeline stops (clicks are held), then delivers every held click at once,
   late, with its own time: the input guard trips, holds the join, and the clicks label their
   items right when they come.
3. ``healthy``.
4. ``lost``: the pipeline stops and its clicks never come: the held windows go to quarantine.
5. ``healthy`` (``--recover-s``): learning resumes by itself.
6. ``bad`` (``--bad-s``): users click what they would not (``UserModel.invert``), at the same rate:
   the output guard trips and the served rows are rewound to the last good delta.
7. ``after`` (``--after-s``, 120 s: the bad requests' join windows close for 30 s after it).

Measured (the joiner's and the trainer's /metrics every 0.5 s, a probe request every 0.5 s, the
samples and quarantine topics read whole, the model's GUARDS.log):

- ``outage``: ``trip_s`` (the slower outage's start to the input guard's trip), ``served_mean_ratio_min``
  (the probe's mean predicted CTR in 5 s buckets: the lowest bucket from the first outage's start to
  the bad labels, over the median bucket of the minute before the first outage; ``_max``: the highest, not a
  target), ``deltas_served_from_outage`` (deltas
  that trained a sample of a request whose clicks were lost), ``lost_samples`` (items of the late
  outage's requests without a sample, or with another label than their clicks say),
  ``quarantined`` (the joiner's count), ``resumed`` (samples trained after the lost outage).
- ``bad_labels``: ``trip_s`` (the bad phase's start to the output guard's trip, GUARDS.log),
  ``rollback_s`` (the trip to the first probe response scored with the rewind's delta),
  ``auc_before`` and ``auc_after`` (the served scores' AUC on the joined samples of the
  ``--phase-s`` before the bad phase and of the last ``--phase-s`` of ``after``).

Writes ``loadtest/results/guard.json``. ``--quick``: short phases at 4 rps (checks the bench).
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import orjson

from loadtest import guard_clear as clear_view
from loadtest import mockbroker
from loadtest.common import (
    given_or_trained,
    keep_work_flag,
    parse,
    parser,
    report_targets,
    work_dir,
    write_results,
)
from loadtest.drive import lean_frontend, request_bodies
from loadtest.paced import Paced
from loadtest.stream_roles import scrape, start, trainer_roles, until_ready
from loadtest.stream_topics import TOPICS, Collector, joiner_role
from loadtest.stream_users import UserModel, play
from model_store.dense import AUTO
from model_store.guards import read_guards
from serving.rpc.procs import free_ports, stop_children
from stream.arms import auc
from stream.records import Event
from stream.sample_batch import read_samples, request_ids


class Pipeline:
    """The click pipeline between the users and the events topic: ``mode`` pass, hold (kept, to
    be ``release``d) or drop; ``inverted`` flips the users' world. Counts what it held and lost."""

    def __init__(self, model: UserModel) -> None:
        self.model, self.inverted_model = model, replace(model, invert=True)
        self.mode, self.inverted = "pass", False
        self.held: list[Event] = []
        self.late: set[str] = set()  # requests with a click held
        self.clicks: dict[str, set[int]] = {}  # request id -> items clicked (sent or held)
        self.lost: set[str] = set()
        self._release = False
        self.lock = threading.Lock()

    def world(self) -> UserModel:
        return self.inverted_model if self.inverted else self.model

    def gate(self, due: list[Event]) -> list[Event]:
        with self.lock:
            if self.mode == "drop":
                self.lost.update(e.request_id for e in due)
                return []
            for e in due:
                self.clicks.setdefault(e.request_id, set()).add(e.item)
            if self.mode == "hold":
                self.held += due
                self.late.update(e.request_id for e in due)
                return []
            if self._release:
                self._release, due, self.held = False, self.held + due, []
            return due

    def set(self, mode: str) -> None:
        with self.lock:
            self._release = self.mode == "hold" and mode == "pass"
            self.mode = mode


def sample_facts(msgs: list) -> dict:
    """The facts of a batch of samples: keys (request, item), labels, served scores, ts, where."""
    s, _ = read_samples([m.value() or b"" for m in msgs])
    where = np.array([(m.partition(), m.offset()) for m in msgs], np.int64).reshape(-1, 2)[s.index]
    at = np.array([m.timestamp()[1] for m in msgs], np.float64)[s.index] / 1000  # produced (wall)
    return {"keys": s.keys, "labels": s.labels, "scores": s.scores, "ts": s.ts, "where": where, "at": at}


def cat(parts: list[dict]) -> dict:
    if not parts:
        return {"keys": np.zeros(0, "S1"), "labels": np.zeros(0), "scores": np.zeros(0), "ts": np.zeros(0),
                "where": np.zeros((0, 2), np.int64), "at": np.zeros(0)}  # fmt: skip
    width = max(p["keys"].dtype.itemsize for p in parts)
    out = {k: np.concatenate([p[k] for p in parts]) for k in ("labels", "scores", "ts", "where", "at")}
    out["keys"] = np.concatenate([p["keys"].astype(f"S{width}") for p in parts])
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--store", help="existing model store (default: train one into a temp dir)")
    p.add_argument("--model", default="criteo")
    p.add_argument("--rate", type=float, default=10.0, help="requests/s of 200 items (default: 10)")
    p.add_argument("--warm-s", type=float, default=120.0, help="the healthy start (default: 120)")
    p.add_argument("--phase-s", type=float, default=90.0, help="each outage and the healthy phase between (default: 90)")  # fmt: skip
    p.add_argument("--recover-s", type=float, default=60.0, help="the healthy phases after (default: 60)")
    p.add_argument("--bad-s", type=float, default=30.0, help="the inverted labels (default: 30)")
    p.add_argument("--after-s", type=float, default=120.0,
                   help="the healthy end (default: 120: the bad requests' windows close for a join window after it)")  # fmt: skip
    p.add_argument("--window-s", type=float, default=30.0,
                   help="the joiner's window (default: 30: longer than the input guard takes to trip)")  # fmt: skip
    p.add_argument("--lr", type=float, default=0.05, help="the streaming trainer's sparse learning rate")
    p.add_argument("--drift-period-s", type=float, default=600.0,
                   help="seconds for an item's taste to go round once (default: 600: slow beside the 30 s "
                        "join window, so that a model trained on closed windows keeps up)")  # fmt: skip
    p.add_argument(
        "--drift-weight", type=float, default=2.0, help="logit amplitude of the taste (default: 2)"
    )
    keep_work_flag(p)
    args = parse(p, argv, {"rate": 4.0, "warm_s": 20.0, "phase_s": 20.0, "recover_s": 20.0, "bad_s": 15.0, "after_s": 22.0,
                           "window_s": 15.0})  # fmt: skip
    with work_dir("bench-guard", args.keep_work) as work:
        store = given_or_trained(args.store, work)
        served = work / "served"
        shutil.copytree(store, served)
        out = run(args, served / args.model, work)
    o, b = out["outage"], out["bad_labels"]
    ok = {"input_trip_le_10s": o["trip_s"] is not None and o["trip_s"] <= 10,
          "served_mean_within_10pct": o["served_mean_ratio_min"] is not None and o["served_mean_ratio_min"] >= 0.9,
          "no_delta_from_outage": o["deltas_served_from_outage"] == 0, "none_lost": o["lost_samples"] == 0,
          "quarantined": o["quarantined"] > 0, "resumed": o["resumed"],
          "rollback_le_5s": b["rollback_s"] is not None and b["rollback_s"] <= 5,
          "auc_back": None not in (b["auc_before"], b["auc_after"]) and b["auc_after"] >= b["auc_before"] - 0.02}  # fmt: skip
    report_targets(out, ok)
    print(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    print(f"wrote {write_results('guard', out, args.results_dir)}")
    return 0


def run(args, model_dir: Path, work: Path) -> dict:
    from serving.scoring.client import ScoringClient

    body = request_bodies()[0]
    with contextlib.ExitStack() as es:
        broker = es.enter_context(mockbroker.running([mockbroker.TopicSpec(t, n) for t, n in TOPICS.items()]))
        b = broker.bootstrap
        endpoint, _ = es.enter_context(lean_frontend(model_dir.parent, args.model, "colocated", None, work, AUTO,
                                                     1.0, ("--log-impressions", f"kafka://{b}/impressions")))  # fmt: skip
        join_port, train_port, standby_port = free_ports(3)
        roles = {"joiner": [*joiner_role(b, args.window_s, "bench-guard", work), "--metrics-port", str(join_port),
                            "--record-to", str(model_dir)]}  # fmt: skip
        roles |= trainer_roles(["train", "--follow", str(model_dir), "--stream", f"kafka://{b}/samples",
                                "--delta-interval-s", "0.5", "--lr", f"{args.lr:g}", "--batch-size", "1024"],
                               [train_port, standby_port], False)  # fmt: skip
        procs: dict = {}
        for name in ("joiner", "trainer"):
            start(roles, procs, work, name)
        es.callback(lambda: stop_children([p for p in procs.values() if p.poll() is None]))
        until_ready(roles, procs, work)
        pipe = Pipeline(
            UserModel(delay_s=2.0, drift_weight=args.drift_weight, drift_period_s=args.drift_period_s)
        )
        stop_users = threading.Event()
        users = threading.Thread(target=play, args=(b, pipe.model, stop_users),
                                 kwargs={"world": pipe.world, "gate": pipe.gate}, daemon=True)  # fmt: skip
        users.start()
        samples, quarantine = (
            Collector(b, "samples", sample_facts),
            Collector(b, "samples.quarantine", sample_facts),
        )
        samples.start()
        quarantine.start()
        probe, series = (
            ScoringClient(endpoint, None),
            [],
        )  # (wall, mean score, delta seq, join tripped, train tripped, trained)
        marks: dict[str, float] = {}
        plan = [("warm", args.warm_s, "pass"), ("late", args.phase_s, "hold"), ("healthy", args.phase_s, "pass"),
                ("lost", args.phase_s, "drop"), ("resume", args.recover_s, "pass"), ("bad", args.bad_s, "bad"),
                ("after", args.after_s, "pass")]  # fmt: skip
        print(f"{args.rate:g} rps; phases " + ", ".join(f"{n} {s:g} s" for n, s, _ in plan), flush=True)
        with Paced(endpoint, body, args.rate):
            for name, seconds, mode in plan:
                marks[name] = time.time()
                pipe.inverted = mode == "bad"
                pipe.set("pass" if mode == "bad" else mode)
                print(f"  {name} at {marks[name] - marks['warm']:.0f} s", flush=True)
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    status, payload = probe.post(body)
                    reply = orjson.loads(payload) if status == 200 else None
                    jm, tm = clear_view.metrics(join_port), clear_view.metrics(train_port)
                    series.append((time.time(), float(np.mean(reply["scores"])) if reply else np.nan,
                                   int(reply["versions"]["delta_seq"]) if reply else -1,
                                   jm.get("recserve_join_guard_tripped"), tm.get("recserve_follow_guard_tripped"),
                                   tm.get("recserve_follow_samples_total"), tm.get("recserve_follow_served_auc"),
                                   jm.get("recserve_join_events_total", np.nan),
                                   clear_view.offsets(tm, TOPICS["samples"])))  # fmt: skip
                    time.sleep(0.5)
            marks["end"] = time.time()
        time.sleep(args.window_s + 5)  # the last requests' windows close, their samples are joined
        quarantined = scrape(join_port, "recserve_join_quarantined_samples_total") or 0.0
        stop_users.set()
        users.join(30)
        from confluent_kafka import Consumer

        watch = Consumer({"bootstrap.servers": b, "group.id": "bench-guard-watch"})
        joined, held = cat(samples.finish(watch)), cat(quarantine.finish(watch))
        watch.close()
        probe.close()
    return figures(args, marks, series, joined, held, pipe, quarantined, model_dir)


def figures(args, marks, series, joined, held, pipe, quarantined, model_dir: Path) -> dict:
    t = np.array([s[0] for s in series])
    mean = np.array([s[1] for s in series])
    seq = np.array([s[2] for s in series])
    join_trip = np.array([s[3] or 0.0 for s in series])
    trained = np.array([s[5] or 0.0 for s in series])
    served_auc_seen = np.array([np.nan if s[6] is None else s[6] for s in series])

    def first(mask, after: float) -> float | None:
        hit = np.flatnonzero(mask & (t >= after))
        return float(t[hit[0]] - after) if len(hit) else None

    trips = [first(join_trip > 0, marks[n]) for n in ("late", "lost")]
    every5 = [(a, float(np.nanmean(mean[(t >= a) & (t < a + 5)]))) for a in np.arange(marks["warm"], marks["end"], 5.0)
              if ((t >= a) & (t < a + 5)).any()]  # fmt: skip
    before = [m for a, m in every5 if marks["late"] - 60 <= a < marks["late"] - 5]
    during = [m for a, m in every5 if marks["late"] <= a < marks["bad"] - 5]
    ratio = float(np.nanmin(during) / np.nanmedian(before)) if before and during else None
    high = float(np.nanmax(during) / np.nanmedian(before)) if before and during else None  # not a target
    rids = np.char.decode(request_ids(joined["keys"]))
    # the outage's samples: of requests scored in it (one scored before whose late click was lost
    # is a sample with a click missing, counted in lost_clicks_before_the_trip)
    from_lost = np.isin(rids, list(pipe.lost)) & (joined["ts"] >= marks["lost"])
    clicks_missing = np.isin(rids, list(pipe.lost)) & (joined["ts"] < marks["lost"])
    lost_where = joined["where"][from_lost]
    deltas_from_outage = _deltas_covering(model_dir, lost_where)
    late_keys = {(r, int.from_bytes(k[:4], "big")): float(lab) for r, k, lab in
                 zip(rids, joined["keys"].tolist(), joined["labels"].tolist(), strict=True) if r in pipe.late}  # fmt: skip
    late_requests = set(pipe.late)
    wrong = sum(1 for (r, i), lab in late_keys.items() if lab != float(i in pipe.clicks[r]))
    missing = sum(200 for r in late_requests) - len(late_keys)
    events, _ = read_guards(model_dir)
    out_trip = next(
        (e for e in events if e.guard == "output" and e.event == "trip" and e.at >= marks["bad"]), None
    )
    rewind = next(
        (e for e in events if e.guard == "output" and e.event == "rewind" and e.at >= marks["bad"]), None
    )
    rollback = None
    if out_trip is not None and rewind is not None:
        seen = np.flatnonzero((seq >= rewind.delta) & (t >= out_trip.at))
        rollback = float(t[seen[0]] - out_trip.at) if len(seen) else None

    def served_auc(lo: float, hi: float) -> float | None:
        m = (joined["ts"] >= lo) & (joined["ts"] < hi)
        y = joined["labels"][m]
        return (
            round(auc(joined["scores"][m].astype(np.float64), y.astype(np.float64)), 4)
            if 0 < y.sum() < len(y)
            else None
        )

    resumed_at = marks["resume"] + args.window_s + 5
    return {
        "conditions": {
            "rate_rps": args.rate,
            "items": 200,
            "phases_s": {k: round(v - marks["warm"], 1) for k, v in marks.items()},
            "join_window_s": args.window_s,
            "machine": "2-vCPU VM, every role and the load on it",
        },  # fmt: skip
        "outage": {
            "trip_s": max(x for x in trips if x is not None) if all(x is not None for x in trips) else None,
            "trip_s_each": trips,
            "served_mean_ratio_min": None if ratio is None else round(ratio, 4),
            "served_mean_ratio_max": None if high is None else round(high, 4),
            "deltas_served_from_outage": deltas_from_outage,
            "lost_outage_samples_joined": int(from_lost.sum()),
            "samples_scored_before_with_a_click_lost": int(clicks_missing.sum()),
            "lost_samples": int(missing + wrong),
            "late_requests": len(late_requests),
            "quarantined": int(quarantined),
            "quarantine_topic": len(held["keys"]),
            "resumed": bool(
                trained[t >= resumed_at].max(initial=0) > trained[t < marks["resume"]].max(initial=0)
            ),
        },
        "bad_labels": {
            "trip_s": None if out_trip is None else round(out_trip.at - marks["bad"], 2),
            "rollback_s": None if rollback is None else round(rollback, 2),
            "rewound_to": None if rewind is None else rewind.to,
            "auc_before": served_auc(marks["bad"] - args.phase_s, marks["bad"]),
            "auc_after": served_auc(marks["end"] - args.phase_s / 2, marks["end"]),
        },
        "served_mean_every_5s": [
            round(float(np.nanmean(mean[(t >= a) & (t < a + 5)])), 4)
            if ((t >= a) & (t < a + 5)).any()
            else None
            for a in np.arange(marks["warm"], marks["end"], 5.0)
        ],  # fmt: skip
        "served_auc_windows": {
            name: _spread(served_auc_seen[(t >= marks[name]) & (t < marks[nxt])])
            for name, nxt in zip(PHASES, [*PHASES[1:], "end"], strict=True)
        },  # fmt: skip
        "guard_events": [
            {"guard": e.guard, "event": e.event, "at_s": round(e.at - marks["warm"], 1), "reason": e.reason}
            for e in events
        ],  # fmt: skip
        "around_clears": _around_clears(series, t, mean, joined, events, marks),
    }


PHASES = ("warm", "late", "healthy", "lost", "resume", "bad", "after")


def _spread(x: np.ndarray) -> dict | None:
    """min, median and max of the trainer's served-AUC gauge over a phase (the output guard's windows)."""
    x = x[np.isfinite(x)]
    return (
        None
        if not len(x)
        else {k: round(float(f(x)), 4) for k, f in (("min", np.min), ("median", np.median), ("max", np.max))}
    )


def _around_clears(series, t, mean, joined, events, marks) -> list[dict]:
    """Each input-guard clear's buckets (``loadtest.guard_clear``), with its trip, clear and the
    pipeline's release (s from the start)."""
    offs = np.array([s[8] for s in series], np.float64)
    trained = clear_view.trained_at(t, offs, joined["where"])
    ev = np.array([s[7] for s in series], np.float64)
    inp = [e for e in events if e.guard == "input"]
    pairs = [
        (a.at, b.at) for a, b in zip(inp, inp[1:], strict=False) if (a.event, b.event) == ("trip", "clear")
    ]
    return [{"trip_s": round(a - marks["warm"], 1), "clear_s": round(b - marks["warm"], 1),
             "buckets": clear_view.around(b, a, t, mean, ev, joined, trained)} for a, b in pairs]  # fmt: skip


def _deltas_covering(model_dir: Path, where: np.ndarray) -> int:
    """Deltas of the served version whose offsets moved past a sample at ``where`` (partition,
    offset): those that trained it."""
    from loadtest.bench_stream import published

    if not len(where):
        return 0
    covered, before = 0, dict.fromkeys(range(TOPICS["samples"]), 0)
    for _, _, record in published(model_dir):
        now = {p: record.positions.get(f"samples/{p}", before[p]) for p in before}
        hit = any(
            ((where[:, 0] == p) & (where[:, 1] >= before[p]) & (where[:, 1] < now[p])).any() for p in now
        )
        covered += bool(hit)
        before = now
    return covered


if __name__ == "__main__":
    import sys

    sys.exit(main())
