"""The watcher's latest look on /metrics (read at scrape time from ``Watcher.latest``).

Labels, kept few:

- per arm, since the experiment's start (counters): ``recserve_experiment_impressions_total``,
  ``_samples_total``, ``_clicks_total`` {experiment, arm};
- per arm and window (gauges): ``recserve_experiment_ctr``, ``_mean_predicted``, ``_calibration``,
  ``_logloss``, ``_auc`` {experiment, arm, window}, ``window`` "all" (since the start) or the
  sliding window ("300s"); each with its confidence interval as two more gauges of the same
  labels, ``<name>_low`` and ``<name>_high`` (NaN where none is meaningful);
- the rule, per candidate: ``recserve_experiment_rule_statistic`` (log L of the mSPRT) and
  ``_difference`` (candidate - control) {experiment, arm}, ``recserve_experiment_rule_verdict``
  {experiment, arm, verdict} (1 for the latest verdict: continue | promote | abort), and
  ``recserve_experiment_rule_threshold`` (no label: the statistic decides at log(1/alpha));
- the role: ``recserve_experiment_records_total``, ``_bad_records_total`` (skipped),
  ``_foreign_samples_total`` (another arm or outside the experiment), ``_rule_changes_total``
  {arm, decision} (what --auto did), ``_rule_refusals_total``, ``_record_errors_total``,
  ``recserve_experiment_auto`` (1 with --auto) and ``recserve_experiment_look_timestamp_seconds``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from stream.arms import ArmMetrics, Estimate

if TYPE_CHECKING:
    from stream.watch.watcher import Watcher

FIGURES = ("ctr", "mean_predicted", "calibration", "logloss", "auc")
"""The per-arm figures with an interval (fields of ``stream.arms.ArmMetrics``)."""
COUNTS = ("impressions", "samples", "clicks")
VERDICTS = ("continue", "promote", "abort")
P = "recserve_experiment_"


class Collector:
    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        w, report = self.watcher, self.watcher.latest
        threshold = math.log(1 / w.rule.alpha)
        yield GaugeMetricFamily(P + "rule_threshold", "The rule decides once its statistic reaches this (log 1/alpha)", value=threshold)  # fmt: skip
        yield GaugeMetricFamily(
            P + "auto", "1 when the rule's verdicts are acted on (--auto)", value=float(w.cfg.auto)
        )
        yield CounterMetricFamily(
            P + "rule_refusals", "Changes of the rule the store refused", value=w.refusals
        )
        yield CounterMetricFamily(P + "record_errors", "Looks at which the experiment record did not read", value=w.record_errors)  # fmt: skip
        changes = CounterMetricFamily(P + "rule_changes", "Arms the rule promoted or aborted (--auto)", labels=["arm", "decision"])  # fmt: skip
        for (arm, decision), n in sorted(w.actions.items()):
            changes.add_metric([arm, decision], n)
        yield changes
        if report is None:
            return
        yield GaugeMetricFamily(
            P + "look_timestamp_seconds", "When the figures shown were computed", value=report.at
        )
        c = report.counts
        for name, doc, value in (("records", "Records read from the samples topic", c.records),
                                 ("bad_records", "Records skipped: not samples, or a label or score the metrics cannot take", c.bad),
                                 ("foreign_samples", "Samples of another arm or scored outside the experiment", c.foreign)):  # fmt: skip
            yield CounterMetricFamily(P + name, doc, value=value)
        exp, window = report.experiment, f"{report.window_s:g}s"
        counts = {k: CounterMetricFamily(P + k, f"{k.capitalize()} of the arm since the experiment's start", labels=["experiment", "arm"]) for k in COUNTS}  # fmt: skip
        figures = {
            f"{k}{part}": GaugeMetricFamily(P + k + part, f"{k}{part.replace('_', ' ')} of the arm", labels=["experiment", "arm", "window"])
            for k in FIGURES for part in ("", "_low", "_high")
        }  # fmt: skip
        for line in report.arms:
            for k in COUNTS:
                counts[k].add_metric([exp, line.arm], getattr(line.cumulative, k))
            for span, m in (("all", line.cumulative), (window, line.window)):
                _figures(figures, [exp, line.arm, span], m)
        yield from counts.values()
        yield from figures.values()
        statistic = GaugeMetricFamily(P + "rule_statistic", "log L of the rule's mSPRT, candidate vs control", labels=["experiment", "arm"])  # fmt: skip
        difference = GaugeMetricFamily(P + "rule_difference", "The rule's metric, candidate minus control", labels=["experiment", "arm"])  # fmt: skip
        verdict = GaugeMetricFamily(P + "rule_verdict", "1 for the rule's latest verdict on the arm", labels=["experiment", "arm", "verdict"])  # fmt: skip
        for rule in report.rule:
            e = rule.typed()
            statistic.add_metric([exp, rule.arm], e.statistic)
            difference.add_metric([exp, rule.arm], e.difference)
            for v in VERDICTS:
                verdict.add_metric([exp, rule.arm, v], float(rule.verdict == v))
        yield from (statistic, difference, verdict)


def _figures(out: dict[str, Any], labels: list[str], m: ArmMetrics) -> None:
    for k in FIGURES:
        e: Estimate = getattr(m, k)
        out[k].add_metric(labels, e.value)
        out[k + "_low"].add_metric(labels, e.low)
        out[k + "_high"].add_metric(labels, e.high)
