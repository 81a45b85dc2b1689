"""``make bench-experiment``: an A/B/C experiment decided by its rule on the joined stream.

    python -m loadtest.bench_experiment [--rate 10] [--quick] [--results-dir DIR] [--store DIR]

On the mock Kafka cluster, simulated users (``loadtest.stream_users``) click the impressions and
``recserve join`` joins them; both frontends follow one model store and log their impressions:
``recserve serve`` (co-located lookups) and TorchServe's handler (an archive whose ``scoring.json``
names the store; ``--no-torchserve`` leaves it out). The load (``--rate`` requests/s of 200
items, open-loop) alternates between them, each request the body of one of ``--units`` users
(the first item's ``C1`` names the user: the experiment's ``--unit-key C1``).

The world (``UserModel`` with a ``reference`` and a ``drift_origin_s``): item ``i`` of the request
is clicked with probability ``sigmoid(logit(reference[i]) + taste_i(t) - taste_i(t0))``, where
``reference`` is the start version's scores of the request (one reply, read before the users
start), ``taste`` the drifting world's rising and falling fashions (``--drift-weight`` 0.7 in
logit, ``--drift-period-s`` 600) and ``t0`` the users' start. Why this world: the issue expects a fresher
A to win and a B trained on shuffled labels to lose, which holds only where clicks follow the
items. In ``make bench-stream``'s world clicks follow the served score (users click what the model
ranks high) and the tastes, not the items' features: there the start version's spread of scores is
noise, a near-constant B has the lower log loss, and the first run of this bench promoted B and
aborted A. Here the truth is a fixed function of the items, so

- control is the truth at ``t0`` and falls behind as the tastes drift (its log loss rises with
  the drift, its calibration stays near 1: the tastes' mean over the items is about 0);
- A, trained on the clicks of the last ``--fresh-s`` before the experiment, knows where the
  tastes went: better than control while the drift since its samples is smaller than since ``t0``
  (from the experiment's start until about half a period after ``t0``: minutes);
- B predicts about the Criteo click rate for every item: no signal, a log loss higher by what
  the reference knows of the items (computed from the start version's and B's scores of the
  request: about 0.027 above control's, while A is about 0.015-0.025 below it).

The drift is mild (0.7, not bench-stream's 2) because the tastes raise the world's click rate as
they spread (sigmoid is convex where items are clicked less than half the time): at 1, B's
higher mean prediction became about as calibrated as control's and its gap fell to 0.014 within
two minutes, while A's advantage grew past B's deficit.

The versions:

- control: the start version (trained offline on Criteo), frozen for the whole run;
- A, fresher: for ``--warm-s`` the loop runs on control; then a version is trained offline
  (``loadtest.common.train_version``: ``recserve train``'s code, unpublished) on the joined samples
  of the last ``--fresh-s`` -- each sample as its item's Criteo row (every request holds the same
  200 rows) with the sample's label. ``--fresh stream`` takes instead the newest full version of
  the streaming trainer (``recserve train --follow --stream --train-dense --full-every``, on a copy
  of the store), what the issue's canaries are; not the default: in trial runs before c8b2f00's
  streaming loss those versions predicted about twice the observed click rate (calibration
  1.9-2.0) and the calibration guardrail aborted them; since, one was promoted (calibration 0.99,
  docs/benchmarks.md);
- B, worse on purpose: ``train_version`` on a copy of the Criteo training file whose labels are
  permuted (seeded): a model of no signal.

Then ``recserve experiment start --candidate A --share 0.1 --candidate B --share 0.1 --unit-key C1``
(80/10/10) with ``recserve experiment watch --auto`` running, until the rule has decided both
candidates or the experiment ended (``--decide-s`` at most). The rule is the defaults but for
``--min-samples`` 20,000 an arm (100 requests; the default is 10,000): a promotion ends the
experiment, so a worse candidate is aborted only if its evidence is in before the better one's;
with 20,000 samples both differences (above) are past the mSPRT's bound (about 0.014 in log loss
at 20,000 against 160,000) at the look that first may decide, where at 10,000 (bound about 0.019)
a B whose measured gap came out low would be left undecided by A's promotion. The impressions and samples topics are read whole as they fill; users
and joiner stop before they are read to their end. Figures (rules in ``loadtest.experiment_figures``):

- ``decisions``, ``samples_to_decision`` (EXPERIMENTS.log: the decision's evidence);
- ``metric_max_abs_diff``: the watch role's report (``EXPERIMENT.metrics.json``, once it holds
  every sample of the experiment) against ``stream.arms.arm_metrics`` over the samples the role
  owns by its rule (``experiment_figures.recompute``), from the samples topic read whole;
- ``mixed_responses``; ``units_in_two_arms`` (and ``units_off_their_arm``), start to first decision;
- ``split_p99_ratio``: after the experiment, on the same frontend at the same load, phases with a
  running experiment (control CURRENT, the two other versions at 10% each) and without, ABBA,
  ``--p99-rounds`` x ``--p99-phase-s`` each at ``--p99-rate``; p99 of each side's pooled
  latencies (per frontend; the headline is ``recserve serve``'s; ``split_p99_requests_per_side``:
  what it rests on). The phases are short and many (12 x 5 s, since the 6 x 10 s of stop 61)
  so that a busy spell of the shared machine falls on both sides alike: in one run on the dev VM
  a phase's p99 ranged from 6.8 to 12.7 ms between rounds a minute apart. Beside it, per frontend, each round's p99 of each side and ``halves``: the
  p99 of a side's even rounds over its odd rounds' (an A/A at half the requests, from the same
  phases: the bench's own noise); ``--p99-aa`` runs the phases once more with no experiment on
  either side (``split_p99_aa``: the A/A at the same number of requests);
- ``aa_replays``, ``aa_false_decision_rate``: ``stream.aa.aa_replays`` with the bench's rule over
  the samples control's version scored in this run (before the experiment, and control's during
  it), in event-time order, units = request ids; ``aa_rule_defaults`` (the rule's defaults),
  ``aa_test_only`` (no calibration guardrail) and ``aa_by_unit_key`` (units = the unit key).

Writes ``loadtest/results/experiment.json``. ``--quick``: short phases at 6 rps (checks the bench).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

import model_store as ms
from features.schema import load_schema
from loadtest import experiment_figures as ef
from loadtest import experiment_parts as ep
from loadtest import mockbroker
from loadtest.common import (
    CRITEO_TRAIN,
    given_or_trained,
    keep_work_flag,
    parse,
    parser,
    report_targets,
    train_version,
    work_dir,
    write_results,
)
from loadtest.drive import lean_frontend, request_bodies
from loadtest.processes import wait_for
from loadtest.stream_roles import start, trainer_roles
from loadtest.stream_topics import TOPICS, Collector, joiner_role
from loadtest.stream_users import UserModel, play
from model_store import experiments as ex
from model_store.dense import AUTO
from serving.rpc.procs import free_ports, spawn, stop_children
from serving.scoring.arms import Unit
from stream.sequential import SequentialConfig
from stream.watch import read_report

UNIT_SLOT = "C1"
SPLIT_P99_TARGET = 1.05
AA_TARGET = 0.05
NAME = "bench-ab"


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--store", help="existing model store (default: train one into a temp dir)")
    p.add_argument("--model", default="criteo")
    p.add_argument("--rate", type=float, default=10.0, help="requests/s of 200 items (default: 10)")
    p.add_argument("--units", type=int, default=200, help="users sending the requests (default: 200)")
    p.add_argument("--warm-s", type=float, default=90.0, help="the stream trains A meanwhile (default: 90)")
    p.add_argument("--fresh", choices=["samples", "stream"], default="samples",
                   help="A: trained offline on the last --fresh-s of joined samples (default), or the streaming "
                        "trainer's newest full version")  # fmt: skip
    p.add_argument(
        "--fresh-s", type=float, default=45.0, help="seconds of samples A is trained on (default: 45)"
    )
    p.add_argument("--full-every", default="20s", help="the streaming trainer's full versions (default: 20s)")
    p.add_argument(
        "--lr", type=float, default=0.01, help="the streaming trainer's sparse learning rate (default: 0.01)"
    )
    p.add_argument("--decide-s", type=float, default=150.0, help="most seconds of experiment (default: 150)")
    p.add_argument("--window-s", type=float, default=10.0, help="the joiner's window (default: 10)")
    p.add_argument("--drift-weight", type=float, default=0.7,
                   help="logit amplitude of each item's drifting taste (default: 0.7)")  # fmt: skip
    p.add_argument("--drift-period-s", type=float, default=600.0,
                   help="seconds for an item's taste to go round once (default: 600: A, trained before the "
                        "experiment, stays ahead of control while the rule decides)")  # fmt: skip
    p.add_argument("--p99-phase-s", type=float, default=5.0, help="one with/without phase (default: 5)")
    p.add_argument("--p99-rounds", type=int, default=12,
                   help="with/without phases of each side (default: 12; see the docstring)")  # fmt: skip
    p.add_argument("--p99-rate", type=float, default=30.0,
                   help="requests/s of the with/without phases (default: 30: 1,800 requests a side)")  # fmt: skip
    p.add_argument("--p99-aa", action="store_true",
                   help="also run the with/without phases with no experiment on either side (an A/A: the bench's "
                        "own noise at the same number of requests; split_p99_aa)")  # fmt: skip
    p.add_argument("--min-samples", type=int, default=20_000,
                   help="the rule's samples per arm before its test may decide (default: 20000; see above)")  # fmt: skip
    p.add_argument("--min-clicks", type=int,
                   help="the candidate's clicks before its calibration is judged (default: the rule's, 1000)")  # fmt: skip
    p.add_argument("--aa-replays", type=int, default=60, help="A/A replays (default: 60)")
    p.add_argument(
        "--torchserve",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run TorchServe's handler too",
    )
    keep_work_flag(p)
    args = parse(p, argv, {"rate": 6.0, "warm_s": 35.0, "fresh_s": 20.0, "full_every": "10s", "decide_s": 50.0, "window_s": 4.0,
                           "p99_phase_s": 1.5, "min_samples": 2000, "min_clicks": 300, "p99_rounds": 2, "aa_replays": 50})  # fmt: skip
    with work_dir("bench-experiment", args.keep_work) as work:
        store = given_or_trained(args.store, work)
        served = work / "served"
        shutil.copytree(store, served)
        out = run(args, served, work)
    ratio, aa = out["split_p99_ratio"], out["aa_false_decision_rate"]
    ok = {"A promoted, B aborted": out["decisions"] == {"A": "promoted", "B": "aborted"},
          "metrics equal their recomputation (1e-9)": (out["metric_max_abs_diff"] is not None
                                                      and out["metric_max_abs_diff"] <= 1e-9),
          "0 mixed responses": out["mixed_responses"] == 0, "every unit in one arm": out["units_in_two_arms"] == 0,
          f"split p99 <= {SPLIT_P99_TARGET}x": ratio is not None and ratio <= SPLIT_P99_TARGET,
          f"A/A false decisions <= {AA_TARGET:.0%} ({out['aa_replays']} replays)": aa is not None and aa <= AA_TARGET}  # fmt: skip
    if aa is not None and aa > AA_TARGET:
        print(f"\nNOTE: the rule decided in {aa:.0%} of A/A replays of this run's samples (units: request "
              "ids), over its 5% target: it treats the 200 samples of a request as independent.")  # fmt: skip
    report_targets(out, ok)
    print(f"wrote {write_results('experiment', out, args.results_dir)}")
    return 0


def recserve(*argv: str) -> str:
    """``recserve ARGV`` to its end (a RuntimeError with its output when it fails); its stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "recserve", *argv], capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise RuntimeError(f"recserve {' '.join(argv)} exited {done.returncode}: {done.stderr[-2000:]}")
    return done.stdout


def run(args, root: Path, work: Path) -> dict:
    model, control = args.model, ms.current(root, args.model) or ""
    print("training B on shuffled labels ...", flush=True)
    shuffled = ep.shuffled_labels(CRITEO_TRAIN, work / "shuffled.tsv")
    version_b = Path(train_version(root, seed=1, publish=False, data=shuffled).version_dir).name
    bodies = ep.unit_bodies(request_bodies()[0], args.units, UNIT_SLOT)
    schema = load_schema(ms.version_dir(root, model, control) / "schema.yaml")
    unit = Unit(UNIT_SLOT, schema)
    load_before = os.getloadavg()
    with contextlib.ExitStack() as es:
        broker = es.enter_context(mockbroker.running([mockbroker.TopicSpec(t, n) for t, n in TOPICS.items()]))
        b = broker.bootstrap
        log = f"kafka://{b}/impressions"
        endpoints = {"lean": es.enter_context(lean_frontend(root, model, "colocated", None, work, AUTO, 1.0,
                                                            ("--log-impressions", log, "--poll-s", "1",
                                                             "--drain-s", "1")))[0]}  # fmt: skip
        if args.torchserve:
            print("starting TorchServe ...", flush=True)
            endpoints["torchserve"] = es.enter_context(ep.torchserve_frontend(root, model, work, log))
        collect = {"impressions": Collector(b, "impressions", lambda m: ep.impression_facts(m, unit)),
                   "samples": Collector(b, "samples", ep.sample_facts)}  # fmt: skip
        for c in collect.values():
            c.start()
        procs: dict = {}
        es.callback(lambda: stop_children([p for p in procs.values() if p.poll() is None]))
        fresh = work / "fresh"  # the streaming trainer's copy: A is trained there, control stays as it was
        if args.fresh == "stream":
            shutil.copytree(root, fresh, ignore=shutil.ignore_patterns(".*"))
        roles = {"joiner": joiner_role(b, args.window_s, "bench-experiment", work)}
        if args.fresh == "stream":
            roles |= trainer_roles(["train", "--follow", str(fresh / model), "--stream", f"kafka://{b}/samples",
                                    "--delta-interval-s", "0.5", "--lr", f"{args.lr:g}", "--batch-size", "1024",
                                    "--train-dense", "--full-every", args.full_every, "--max-auc-drop", "1"],
                                   free_ports(2), False)  # fmt: skip
        for name in roles:
            start(roles, procs, work, name)
        joined = work / "joiner.log"
        wait_for(lambda: "join: assigned partitions" in joined.read_text(errors="replace"), 120, "the joiner",
                 [(n, p, work / f"{n}.log") for n, p in procs.items()])  # fmt: skip
        stop_users = threading.Event()
        es.callback(stop_users.set)
        reference = ep.reference_scores(
            endpoints["lean"], bodies[0], control
        )  # before any click: no delta yet
        world = UserModel(delay_s=2.0, drift_weight=args.drift_weight, drift_period_s=args.drift_period_s,
                          reference=reference, drift_origin_s=time.time())  # fmt: skip
        users = threading.Thread(target=play, args=(b, world, stop_users), daemon=True)
        users.start()
        with ep.UnitLoad(endpoints, bodies, args.rate) as load:
            print(f"{args.rate:g} rps over {', '.join(endpoints)}; the stream trains A for {args.warm_s:g} s",
                  flush=True)  # fmt: skip
            time.sleep(args.warm_s)
            if args.fresh == "stream":
                version_a = ep.adopt_fresh(fresh, root, model, control, procs)
            else:
                version_a = ep.trained_on_samples(
                    root, ep.cat(list(collect["samples"].parts)), args.fresh_s, work
                )
            print(
                f"control {control}, A {version_a} (fresh: {args.fresh}), B {version_b} (shuffled labels)",
                flush=True,
            )
            procs["watch"] = spawn(["experiment", "watch", "--store", str(root), "--model", model, "--brokers", b,
                                    "--auto", "--every-s", "2", "--window-s", f"{WATCH_WINDOW_S:g}",
                                    *rule_flags(args, work)],
                                   work / "watch.log")  # fmt: skip
            recserve("experiment", "start", "--store", str(root), "--model", model, "--name", NAME,
                     "--candidate", version_a, "--share", "0.1", "--candidate", version_b, "--share", "0.1",
                     "--unit-key", UNIT_SLOT, "--salt", NAME)  # fmt: skip
            exp = wait_decided(root, model, args.decide_s)
            time.sleep(args.window_s + 5)  # the experiment's last requests are joined (the users still click)
        end_of_load = time.time()
        stop_users.set()  # no click, then no sample, comes after this: the topic's end is final
        users.join(30)
        time.sleep(args.window_s + 2)  # the joiner closes its last windows
        stop_children([procs.pop("joiner")])
        from confluent_kafka import Consumer

        watch = Consumer({"bootstrap.servers": b, "group.id": "bench-experiment-read"})
        imps = ep.cat(collect["impressions"].finish(watch))
        samples = ep.cat(collect["samples"].finish(watch))
        watch.close()
        report, recomputed = settled(root, model, exp, samples, procs["watch"])
        stop_children([procs.pop("watch")])
        current = ms.current(root, model) or ""
        print(f"split p99: {args.p99_rounds} x {args.p99_phase_s:g} s a side and frontend, CURRENT {current}",
              flush=True)  # fmt: skip
        others = sorted({control, version_a, version_b} - {current})
        p99 = ep.split_p99(args, root, model, endpoints, bodies, UNIT_SLOT, others)
        p99_aa = (
            ep.split_p99(args, root, model, endpoints, bodies, UNIT_SLOT, others, aa=True)
            if args.p99_aa
            else None
        )
    times = {"warm_s": args.warm_s, "experiment_s": round((exp.ended or end_of_load) - exp.started, 1),
             "load_s": round(end_of_load - exp.started + args.warm_s, 1)}  # fmt: skip
    replies = load.table()
    facts = {"replies": replies, "imps": imps, "samples": samples, "report": report, "recomputed": recomputed}
    unit_of = dict(zip(imps["request"].tolist(), imps["unit"].tolist(), strict=True))
    aa = ef.aa_figures(samples, exp, unit_of, args.aa_replays, rule(args), UNIT_SLOT)
    out = ef.figures(root, model, exp, facts, p99, aa)
    if p99_aa is not None:
        out["split_p99_aa"] = p99_aa
    out["versions"] = {"control": control, "A": version_a, "B": version_b}
    out["conditions"] = conditions(args, reference) | {
        "durations": times, "frontends": list(endpoints),
        "load_average": {"before": load_before, "after": os.getloadavg()}}  # fmt: skip
    return out


WATCH_WINDOW_S = 60.0
"""The watch role's sliding window (``--window-s``), and so the recomputation's."""


def rule(args) -> SequentialConfig:
    """The rule the watch role runs: the defaults but for ``--min-samples`` and ``--min-clicks``."""
    given = {"min_samples": args.min_samples, "min_clicks": args.min_clicks}
    return SequentialConfig(**{k: v for k, v in given.items() if v is not None})


def rule_flags(args, work: Path) -> list[str]:
    """The watch role's ``--rule`` file when a flag overrides the defaults (none otherwise)."""
    if args.min_samples is None and args.min_clicks is None:
        return []
    path = work / "rule.yaml"
    path.write_text(f"min_samples: {rule(args).min_samples}\nmin_clicks: {rule(args).min_clicks}\n")
    return ["--rule", str(path)]


def wait_decided(root: Path, model: str, seconds: float) -> ex.Experiment:
    """The experiment once it ended (the rule promoted a candidate or aborted the last) or, after
    ``seconds``, stopped with what it decided."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        exp = ex.read_experiment(root, model)
        if exp is not None and not exp.running:
            break
        time.sleep(1.0)
    else:
        ex.stop(root, model, by="operator")  # the run's end: no decision on what is left
    exp = ex.read_experiment(root, model)
    assert exp is not None
    print(f"  experiment {exp.state} after {(exp.ended or time.time()) - exp.started:.0f} s: "
          + (", ".join(f"{d.arm} {d.decision} by the {d.by}" for d in exp.decisions) or "no decision"), flush=True)  # fmt: skip
    return exp


def settled(root: Path, model: str, exp: ex.Experiment, samples: dict, watch) -> tuple[dict, dict]:
    """The watch role's figures, once its report holds every sample of the experiment the samples
    topic holds (30 s at most), and their recomputation (``experiment_figures.recompute``)."""
    n = int(ef.owned(samples, exp).sum())
    recomputed = ef.recompute(samples, exp, WATCH_WINDOW_S)
    deadline, report = time.monotonic() + 30, None
    while time.monotonic() < deadline and watch.poll() is None:
        report = read_report(root, model)
        if report is not None and report.experiment == exp.name and report.counts.kept >= n:
            break
        time.sleep(1.0)
    if report is None or report.experiment != exp.name:
        return {}, recomputed
    if report.counts.kept != n:
        print(f"  the watch role kept {report.counts.kept} samples, the topic holds {n} of the experiment's span",
              flush=True)  # fmt: skip
    reported = {a.arm: {"arm": a.arm, "cumulative": a.cumulative, "window": a.window} for a in report.arms}
    return reported, recomputed


def conditions(args, reference: tuple[float, ...]) -> dict:
    ref = np.array(reference)
    return {
        "rate_rps": args.rate, "items": 200, "units": args.units, "unit_key": UNIT_SLOT,
        "machine": "2-vCPU VM, every role, both frontends and the load on it",
        "shares": {"control": 0.8, "A": 0.1, "B": 0.1}, "join_window_s": args.window_s,
        "world": {"clicks": "sigmoid(logit(reference[item]) + taste(item, t) - taste(item, t0)), t0 the users' start",
                  "reference": "the start version's scores of the request (one reply before the users start)",
                  "reference_mean": float(ref.mean()), "reference_range": [float(ref.min()), float(ref.max())],
                  "drift_weight": args.drift_weight, "drift_period_s": args.drift_period_s},
        "click_delay_s": 2.0, "fresh": f"{args.fresh} (last {args.fresh_s:g} s)" if args.fresh == "samples" else "stream",
        "rule": asdict(rule(args)), "watch": f"--auto --every-s 2 --window-s {WATCH_WINDOW_S:g}",
        "split_p99": f"{args.p99_rounds} x {args.p99_phase_s:g} s a side and frontend at {args.p99_rate:g} rps after "
        "the experiment (joiner, users, watch stopped), ABBA, pooled p99",
        "aa": f"{args.aa_replays} replays of the samples control's version scored, event-time order, looks every "
        "1000 samples",
    }  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
