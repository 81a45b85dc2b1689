"""``make bench-experiment``'s figures: plain functions over what the run logged (its replies, the
impressions and samples topics read whole, ``EXPERIMENTS.log``), and ``figures`` that assembles
the results.

The rules the counts rest on:

- a reply is *mixed* when its versions are not its arm's: its dense or embedding version differs
  from the version the experiment's record gave its arm (any record of that experiment in
  ``EXPERIMENTS.log``: an arm's version never changes), or, outside an experiment, when its dense
  and embedding versions differ;
- a unit is *in two arms* when impressions of it name two different arms while one record was in
  force (from the experiment's start to its first decision: an abort hands the arm's units to
  control, rightly). A unit's key is recomputed from the impression's batch exactly as
  ``serving.scoring.arms.Unit`` reads it (``experiment_parts.unit_keys``); ``off_their_arm``
  counts the impressions of that span whose arm is not the one ``model_store.experiments.assign``
  gives their unit;
- the *recomputation* (``recompute``) is ``stream.arms.arm_metrics`` over the samples the watch
  role owns by its documented rule (``stream.watch.watcher.span_of``, ``stream.watch.reader``):
  an arm of the experiment, aborted ones included, and an impression scored at or after its start
  and, once it ended, at or before its end; ``max_abs_diff`` compares every figure of the watch
  role's report with it (NaN equals NaN; a NaN against a number is an infinite difference).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

import model_store as ms
from loadtest.common import print_table
from model_store import experiments as ex
from stream.aa import aa_replays
from stream.arms import Samples, arm_metrics
from stream.sequential import SequentialConfig
from stream.watch.watcher import span_of


def arm_versions(entries: list[ex.LogEntry]) -> dict[tuple[str, str], str]:
    """(experiment, arm) -> version, from every record ``EXPERIMENTS.log`` holds."""
    return {(e.record.name, a.name): a.version for e in entries for a in e.record.arms}


def mixed_replies(replies: dict[str, NDArray[Any]], versions: dict[tuple[str, str], str]) -> int:
    """Replies (status 200) whose versions are not their arm's (see the module's rule)."""
    ok = replies["status"] == 200
    n = 0
    for arm, name, dense, emb in zip(replies["arm"][ok], replies["experiment"][ok], replies["dense"][ok],
                                     replies["embedding"][ok], strict=True):  # fmt: skip
        want = versions.get((name, arm)) if arm else dense
        n += dense != want or emb != want
    return int(n)


def units_in_two_arms(units: NDArray[Any], arms: NDArray[Any]) -> int:
    """Units whose impressions (those with an arm) name more than one arm."""
    seen: dict[str, set[str]] = {}
    for u, a in zip(units.tolist(), arms.tolist(), strict=True):
        if a:
            seen.setdefault(u, set()).add(a)
    return sum(len(s) > 1 for s in seen.values())


def off_their_arm(units: NDArray[Any], arms: NDArray[Any], record: ex.Experiment) -> int:
    """Impressions with an arm other than the one ``assign`` gives their unit under ``record``."""
    has = arms != ""
    if not has.any():
        return 0
    want = np.array(record.names(), object)[ex.assign(units[has].astype(np.str_), record)]
    return int((want != arms[has]).sum())


def owned(samples: dict, exp: ex.Experiment) -> NDArray[np.bool_]:
    """Which samples the watch role owns for ``exp`` (the module's rule)."""
    span = span_of(exp)
    mine = np.isin(samples["arm"], list(span.arms)) & (samples["ts"] >= span.started)
    return mine & (samples["ts"] <= (span.ended if span.ended is not None else np.inf))


def recompute(samples: dict, exp: ex.Experiment, window_s: float) -> dict[str, dict]:
    """``arm_metrics`` over the samples the watch role owns: {arm: {arm, cumulative, window}}."""
    mine = owned(samples, exp)
    got = Samples.of(samples["arm"][mine].astype(np.str_), samples["score"][mine], samples["label"][mine],
                     samples["ts"][mine], samples["request"][mine].astype(np.str_))  # fmt: skip
    return {str(k): asdict(v) for k, v in arm_metrics(got, window_s).items()}


def _leaves(x: Any, prefix: str = "") -> dict[str, float]:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        x = dataclasses.asdict(x)
    if isinstance(x, dict):
        return {k: v for key, val in x.items() for k, v in _leaves(val, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): float(x)} if isinstance(x, int | float) else {}


def max_abs_diff(reported: dict[str, Any], recomputed: dict[str, Any]) -> float | None:
    """The largest difference between two {arm: {cumulative, window}} sets of figures (None: no
    arm in common; an arm in one only: infinite)."""
    if not reported or set(reported) != set(recomputed):
        return None if not reported else math.inf
    worst = 0.0
    for arm, figures in reported.items():
        a, b = _leaves(figures), _leaves(recomputed[arm])
        if set(a) != set(b):
            return math.inf
        for k, x in a.items():
            y = b[k]
            if math.isnan(x) and math.isnan(y):
                continue
            worst = max(worst, abs(x - y) if not (math.isnan(x) or math.isnan(y)) else math.inf)
    return worst


def decisions(entries: list[ex.LogEntry], name: str) -> tuple[dict[str, str | None], dict[str, Any]]:
    """Per candidate arm of experiment ``name``: what became of it (promoted | aborted | None: the
    experiment ended first, or the run did) and, when decided, the samples and seconds it took (the
    decision's evidence: the candidate's and control's samples at the look that decided)."""
    mine = [e for e in entries if e.record.name == name]
    if not mine:
        return {}, {}
    first = mine[0].record
    out: dict[str, str | None] = {a.name: None for a in first.arms if a.name != ex.CONTROL and not a.shadow}
    took: dict[str, Any] = {}
    for d in mine[-1].record.decisions:
        out[d.arm] = d.decision
        ev = d.evidence
        took[d.arm] = {"candidate": ev.get("n_candidate"), "control": ev.get("n_control"),
                       "total": (ev.get("n_candidate") or 0) + (ev.get("n_control") or 0),
                       "seconds": round(d.at - first.started, 1), "by": d.by,
                       "reasons": list(ev.get("reasons", []))}  # fmt: skip
    return out, took


def aa_figures(samples: dict, exp: ex.Experiment, unit_of: dict, replays: int, rule: SequentialConfig,
               unit_key: str) -> dict:  # fmt: skip
    """A/A replays over the samples control's version scored (before the experiment, and
    control's during it), in event-time order: units = request ids with ``rule`` (the headline),
    with the rule's defaults, with the test alone, and units = the unit key."""
    v1 = ((samples["arm"] == ex.CONTROL) & (samples["ts"] >= exp.started)) | (
        (samples["arm"] == "") & (samples["ts"] < exp.started))  # fmt: skip
    order = np.argsort(samples["ts"][v1], kind="stable")
    score, label = samples["score"][v1][order], samples["label"][v1][order]
    rids = samples["request"][v1][order].astype(np.str_)
    units = np.array([unit_of.get(r, r) for r in rids.tolist()], np.str_)
    test_only = replace(rule, calibration_band=(1e-9, 1e9))  # the mSPRT alone: no calibration guardrail
    runs = {"rule": (rids, rule), "defaults": (rids, SequentialConfig()), "test": (rids, test_only),
            "unit": (units, rule)}  # fmt: skip
    got = {k: aa_replays(u, score, label, replays, cfg) for k, (u, cfg) in runs.items()}

    def brief(r: Any, **more: Any) -> dict:
        return {"false_decision_rate": r.false_decision_rate, "false_promotions": r.false_promotions,
                "false_aborts": r.false_aborts, **more}  # fmt: skip

    aa = got["rule"]
    return {
        "aa_replays": aa.replays,
        "aa_false_decision_rate": aa.false_decision_rate,
        "aa": {
            "units": "request ids",
            "samples": aa.samples,
            "false_promotions": aa.false_promotions,
            "false_aborts": aa.false_aborts,
            "samples_to_false_decision": aa.samples_to_false_decision,
            "requests": len(np.unique(rids)),
        },  # fmt: skip
        "aa_rule_defaults": brief(got["defaults"], units="request ids", rule=asdict(SequentialConfig())),
        "aa_test_only": brief(got["test"], units="request ids", calibration_guardrail="off"),
        "aa_by_unit_key": brief(
            got["unit"], units=f"unit key ({unit_key})", unit_count=len(np.unique(units))
        ),
    }


def figures(root: Any, model: str, exp: ex.Experiment, facts: dict, p99: dict, aa: dict) -> dict:
    """The bench's results from its facts (``replies``, ``imps``, ``samples``, ``report``,
    ``recomputed``), the split's p99 and the A/A figures; prints the arms and the checks."""
    log = ex.read_log(root, model)
    decided, took = decisions(log, exp.name)
    replies, imps = facts["replies"], facts["imps"]
    first = min([d.at for d in exp.decisions] + [exp.ended or np.inf])
    start_record = next(e.record for e in log if e.record.name == exp.name)
    during = (imps["ts"] >= exp.started) & (imps["ts"] < first) & (imps["arm"] != "")
    in_exp = (replies["experiment"] == exp.name) & (replies["done"] < first)
    lean = p99.get("lean", {})
    ok = replies["status"] == 200
    out = {
        "decisions": decided,
        "samples_to_decision": took,
        "metric_max_abs_diff": max_abs_diff(facts["report"], facts["recomputed"]),
        "mixed_responses": mixed_replies(replies, arm_versions(log)),
        "units_in_two_arms": units_in_two_arms(imps["unit"][during], imps["arm"][during]),
        "units_off_their_arm": off_their_arm(imps["unit"][during], imps["arm"][during], start_record),
        "units_in_two_arms_replies": units_in_two_arms(
            replies["unit"][in_exp].astype(str), replies["arm"][in_exp]
        ),
        "split_p99_ratio": lean.get("ratio"),
        "split_p99_requests_per_side": lean.get("requests"),
        "split_p99": p99,
        **aa,
        "experiment": {
            "state": exp.state,
            "current_after": ms.current(root, model),
            "arms": {k: v["cumulative"] for k, v in facts["recomputed"].items()},
        },  # fmt: skip
        "requests": {
            fe: {
                "ok": int((ok & (replies["frontend"] == fe)).sum()),
                "failed": int((~ok & (replies["frontend"] == fe)).sum()),
            }
            for fe in np.unique(replies["frontend"]).tolist()
        },  # fmt: skip
        "impressions": {
            "all": len(imps.get("ts", [])),
            "in_experiment": int(during.sum()),
            "by_arm": {a: int((imps["arm"][during] == a).sum()) for a in start_record.names()},
        },  # fmt: skip
    }
    print_table(f"experiment {exp.name}: {exp.state}",
                [{"arm": a, "decision": decided.get(a, "control"), "samples": m["samples"], "ctr": m["ctr"]["value"],
                  "calibration": m["calibration"]["value"], "logloss": m["logloss"]["value"], "auc": m["auc"]["value"],
                  "to_decision": (took.get(a) or {}).get("total")} for a, m in out["experiment"]["arms"].items()],
                ["arm", "decision", "samples", "ctr", "calibration", "logloss", "auc", "to_decision"])  # fmt: skip
    checks = ["metric_max_abs_diff", "mixed_responses", "units_in_two_arms", "split_p99_ratio", "aa_replays",
              "aa_false_decision_rate"]  # fmt: skip
    print_table("checks", [{k: out[k] for k in checks}], checks)
    return out
