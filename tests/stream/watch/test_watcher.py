"""The experiment's metrics role in-process, against the session's mock broker: every arm's figures
(on /metrics, in the report file) equal ``stream.arms.arm_metrics`` over the same samples to 1e-9,
a restarted watcher recomputes them exactly, and ``--auto`` promotes a better candidate and aborts
a worse one through the store, with the rule's evidence."""

from __future__ import annotations

import math
import time
import uuid

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import model_store as ms
from model_store import experiments as ex
from stream.arms import ArmMetrics, arm_metrics
from stream.sequential import SequentialConfig
from stream.watch import WatchConfig, Watcher, WatchReport, read_report
from stream.watch.metrics import FIGURES
from tests.helpers import wait_until
from tests.stream.helpers import produce
from tests.stream.watch.helpers import concat, experiment_store, impressions, inverted, mixed, noisy, truthful

WINDOW_S = 2.0
ARMS = (("control", noisy), ("A", truthful), ("B", inverted))


def read_everything(watcher: Watcher, n: int) -> WatchReport:
    """Look once (the reader opens at the experiment's start), read all ``n`` records, look again."""
    assert watcher.look() is not None
    wait_until(lambda: watcher.feed() >= 0 and watcher.reader.counts.records >= n, 60, f"{n} records read")
    report = watcher.look()
    assert report is not None
    return report


def max_diff(got: ArmMetrics, want: ArmMetrics) -> float:
    """The largest difference between two arms' figures (counts exactly equal; NaN only with NaN)."""
    assert (got.impressions, got.samples, got.clicks) == (want.impressions, want.samples, want.clicks)
    worst = 0.0
    for k in FIGURES:
        for a, b in zip(vars(getattr(got, k)).values(), vars(getattr(want, k)).values(), strict=True):
            assert math.isnan(a) == math.isnan(b), (k, a, b)
            worst = max(worst, 0.0 if math.isnan(a) else abs(a - b))
    return worst


def scraped(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}  # fmt: skip


def test_every_arms_figures_equal_a_recomputation_from_the_samples_topic(kafka, tmp_path):
    exp = experiment_store(tmp_path)
    topic = kafka.create_topic(f"samples-watch-{uuid.uuid4().hex[:8]}", 3)
    rng = np.random.default_rng(0)
    ours = [impressions(arm, 150, exp.started + 1, rng, scorer) for arm, scorer in ARMS]
    foreign = [
        impressions("", 20, exp.started + 1, rng, truthful),  # served outside any experiment
        impressions("Z", 20, exp.started + 1, rng, truthful),  # an arm this experiment has not
        impressions("A", 20, exp.started - 30, rng, truthful, prefix="early-"),  # scored before it started
    ]
    records = [*mixed(ours + foreign, rng), ("junk", b"not a sample")]
    produce(kafka.bootstrap, topic, records)
    cfg = WatchConfig(brokers=kafka.bootstrap, samples=topic, window_s=WINDOW_S)
    registry = CollectorRegistry()
    watcher = Watcher(
        tmp_path, "m", cfg, SequentialConfig(min_samples=1000, min_clicks=100), registry=registry
    )
    try:
        report = read_everything(watcher, len(records))
        metrics = scraped(registry)
    finally:
        watcher.close()

    assert (report.counts.records, report.counts.bad) == (len(records), 1)
    assert (report.counts.foreign, report.counts.kept) == (3 * 20 * 4, 3 * 150 * 4)
    want = arm_metrics(concat(ours).samples(), WINDOW_S)
    assert sorted(a.arm for a in report.arms) == sorted(want) == ["A", "B", "control"]
    assert read_report(tmp_path, "m") == report  # the file holds the look /metrics shows
    worst = 0.0
    for arm, w in want.items():
        line = report.arm(str(arm))
        assert line is not None and line.window.samples < line.cumulative.samples  # the window is a part
        worst = max(worst, max_diff(line.cumulative, w.cumulative), max_diff(line.window, w.window))
        labels = {"experiment": "t", "arm": str(arm)}
        for k in ("impressions", "samples", "clicks"):
            assert metrics[(f"recserve_experiment_{k}_total", tuple(sorted(labels.items())))] == getattr(
                w.cumulative, k
            )
        for window, m in (("all", w.cumulative), (f"{WINDOW_S:g}s", w.window)):
            key = tuple(sorted({**labels, "window": window}.items()))
            for k in FIGURES:
                for part, value in zip(("", "_low", "_high"), vars(getattr(m, k)).values(), strict=True):
                    shown = metrics[(f"recserve_experiment_{k}{part}", key)]
                    assert shown == pytest.approx(value, abs=1e-9, nan_ok=True), (arm, window, k, part)
    assert worst <= 1e-9, worst
    # without --auto the verdicts are shown, not acted on: the inverted arm breaks the calibration guardrail
    verdicts = {r.arm: r.verdict for r in report.rule}
    assert verdicts["B"] == "abort" and "calibration" in r_reasons(report, "B")
    assert (
        metrics[
            ("recserve_experiment_rule_verdict", (("arm", "B"), ("experiment", "t"), ("verdict", "abort")))
        ]
        == 1
    )
    assert ex.read_experiment(tmp_path, "m").decisions == [] and watcher.actions == {}

    again = Watcher(tmp_path, "m", cfg)  # a restart reads from the experiment's start again
    try:
        redone = read_everything(again, len(records))
    finally:
        again.close()
    assert [a.arm for a in redone.arms] == [a.arm for a in report.arms]
    for a, b in zip(
        redone.arms, report.arms, strict=True
    ):  # partitions interleave anew: sums differ in rounding
        assert max(max_diff(a.cumulative, b.cumulative), max_diff(a.window, b.window)) <= 1e-12


def r_reasons(report: WatchReport, arm: str) -> str:
    return "; ".join(next(r for r in report.rule if r.arm == arm).typed().reasons)


def test_auto_promotes_a_better_candidate_and_aborts_a_worse_one_with_their_evidence(kafka, tmp_path):
    exp = experiment_store(tmp_path)
    topic = kafka.create_topic(f"samples-auto-{uuid.uuid4().hex[:8]}", 2)
    rng = np.random.default_rng(1)
    ours = [
        impressions(arm, 400, exp.started + 1, rng, scorer) for arm, scorer in ARMS
    ]  # 1,600 samples an arm
    records = mixed(ours, rng)
    produce(kafka.bootstrap, topic, records)
    rule = SequentialConfig(min_samples=1000, min_clicks=100)  # 1,600 samples an arm: decided early
    watcher = Watcher(tmp_path, "m", WatchConfig(brokers=kafka.bootstrap, samples=topic, auto=True), rule)
    try:
        read_everything(watcher, len(records))
        later = watcher.look()  # the experiment ended: nothing more to judge or do
    finally:
        watcher.close()

    record = ex.read_experiment(tmp_path, "m")
    assert record is not None and record.state == ex.PROMOTED
    assert [(d.arm, d.version, d.decision, d.by) for d in record.decisions] == [
        ("B", "3", "aborted", "rule"),
        ("A", "2", "promoted", "rule"),
    ]
    aborted, promoted = (d.evidence for d in record.decisions)
    assert promoted["n_candidate"] == 1600 and promoted["difference"] < 0  # log loss lower than control's
    assert promoted["statistic"] >= promoted["threshold"] == pytest.approx(math.log(1 / 0.05))
    assert any("better" in r for r in promoted["reasons"])
    assert aborted["calibration"] > 1.25 and any("calibration" in r for r in aborted["reasons"])
    assert ms.current(tmp_path, "m") == "2"  # published through the gate
    assert [(e.event, e.by) for e in ex.read_log(tmp_path, "m")] == [
        ("started", "operator"),
        ("aborted", "rule"),
        ("promoted", "rule"),
    ]
    assert watcher.actions == {("B", ex.ABORTED): 1, ("A", ex.PROMOTED): 1} and watcher.refusals == 0
    assert later is not None and later.state == ex.PROMOTED and later.rule == []
    assert (
        watcher.reader is None or watcher.reader.span.ended == record.ended
    )  # no sample after the end counts


def test_samples_read_before_an_operators_stop_was_seen_and_scored_after_it_are_forgotten(kafka, tmp_path):
    exp = experiment_store(tmp_path)
    topic = kafka.create_topic(f"samples-stop-{uuid.uuid4().hex[:8]}", 2)
    rng = np.random.default_rng(2)
    before = [impressions(arm, 30, exp.started, rng, scorer) for arm, scorer in ARMS]  # 1.5 s of them
    after = [impressions(arm, 10, time.time() + 600, rng, scorer, "late-") for arm, scorer in ARMS]
    records = mixed(before + after, rng)
    produce(kafka.bootstrap, topic, records)
    watcher = Watcher(tmp_path, "m", WatchConfig(brokers=kafka.bootstrap, samples=topic, window_s=WINDOW_S))
    try:
        assert read_everything(watcher, len(records)).counts.kept == len(
            records
        )  # still running: all its own
        last = max(max(p.ts) for p in before)
        wait_until(lambda: time.time() > last, 10, "the clock past the experiment's last sample")
        ex.stop(tmp_path, "m")  # between two looks; the late samples were scored after it
        report = watcher.look()
    finally:
        watcher.close()

    assert report is not None and report.state == ex.STOPPED
    assert (report.counts.kept, report.counts.foreign) == (3 * 30 * 4, 3 * 10 * 4)
    want = arm_metrics(concat(before).samples(), WINDOW_S)
    for arm, w in want.items():
        line = report.arm(str(arm))
        assert line is not None
        assert max(max_diff(line.cumulative, w.cumulative), max_diff(line.window, w.window)) <= 1e-9
