"""``recserve experiment watch``: an experiment's metrics role (issue 56, parts 4 and 5).

``Watcher(root, model, cfg, rule).run(stop)`` runs until ``stop`` is set:

1. every ``cfg.every_s`` it looks (``look``): it reads the model's experiment record (keeping the
   last good one when the record does not read); another experiment (another name or start) gets
   a fresh ``SampleReader`` from its start and fresh figures;
2. between looks it reads the samples topic and feeds each read's samples of the experiment to one
   ``stream.arms.ArmsAccumulator`` (per arm, vectorised; no loop per sample);
3. a look computes every arm's figures (``ArmsAccumulator.report``: cumulative and over the last
   ``cfg.window_s`` of event time) and, while the experiment runs, the rule's verdict on each
   candidate that serves units against control (``stream.sequential.decide`` on the arms' running
   sums; its calibration guardrail reads them too; p99 latency and error rate are not measured
   from samples, so those guardrails are not checked here). The look is one ``WatchReport``:
   /metrics shows it, ``<model>/EXPERIMENT.metrics.json`` holds it;
4. with ``cfg.auto`` it acts through ``model_store.experiments`` (``by="rule"``, the evidence
   recorded, a line in EXPERIMENTS.log): first every candidate the rule aborts, then at most one
   promotion (of the promoted candidates, the one with the largest statistic), which publishes
   through the gate and ends the experiment. A change the store refuses (an operator acted first,
   the gate said no) is logged and counted and not tried again for that arm.

Every verdict that changes is logged; without ``--auto``, as what the rule would do. The figures
/metrics and the report show are the latest look's (at most ``every_s`` old), so the AUC's sort
runs once a look, not once a scrape.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any

from confluent_kafka import Consumer

from model_store import experiments as ex
from model_store.errors import ModelStoreError
from model_store.releases import Root
from stream.arms import ArmsAccumulator, ArmSums
from stream.config import kafka_settings
from stream.sequential import SequentialConfig, decide
from stream.watch.config import WatchConfig
from stream.watch.reader import SampleReader, Span, partitions
from stream.watch.report import ArmLine, RuleLine, WatchReport, write_report

log = logging.getLogger("recserve.experiment")


def span_of(exp: ex.Experiment) -> Span:
    """The samples an experiment owns: those of its arms (aborted ones too), scored while it ran."""
    names = dict.fromkeys([*exp.names(), *(d.arm for d in exp.decisions)])
    return Span(exp.started, tuple(names), exp.ended)


def candidates(exp: ex.Experiment) -> list[str]:
    """The arms the rule judges: every arm but control that serves units (a shadow serves none)."""
    return [a.name for a in exp.arms if a.name != ex.CONTROL and not a.shadow]


class Watcher:
    def __init__(self, root: Root, model: str, cfg: WatchConfig, rule: SequentialConfig | None = None,
                 registry: Any = None) -> None:  # fmt: skip
        self.root, self.model, self.cfg = root, model, cfg
        self.rule = rule or SequentialConfig()
        self.exp: ex.Experiment | None = None
        self.reader: SampleReader | None = None
        self.acc = ArmsAccumulator(cfg.window_s)
        self.latest: WatchReport | None = None
        """The latest look (replaced whole: a scrape never sees half of one)."""
        self.actions: dict[tuple[str, str], int] = {}
        """(arm, promoted | aborted) -> changes the rule made."""
        self.refusals = 0
        """Changes of the rule the store refused."""
        self.record_errors = 0
        """Looks at which the experiment record did not read (the last good one was kept)."""
        self._said: dict[str, str] = {}  # arm -> the verdict last logged
        self._given_up: set[str] = set()  # arms whose change the store refused
        if registry is not None:
            from stream.watch.metrics import Collector

            registry.register(Collector(self))

    def check_topic(self) -> int:
        """The samples topic's partition count; WatchError naming what is missing."""
        consumer = Consumer({"bootstrap.servers": self.cfg.brokers, "group.id": self.cfg.group,
                             **kafka_settings(self.cfg.kafka_config)})  # fmt: skip
        try:
            return len(partitions(consumer, self.cfg))
        finally:
            consumer.close()

    def run(self, stop: threading.Event) -> None:
        """Read and look until ``stop`` is set."""
        next_look = time.monotonic()
        try:
            while not stop.is_set():
                if time.monotonic() >= next_look:
                    self.look()
                    next_look = time.monotonic() + self.cfg.every_s
                if self.reader is None:  # no experiment yet
                    stop.wait(min(self.cfg.every_s, 0.5))
                else:
                    self.feed()
        finally:
            self.close()

    def feed(self, timeout_s: float = 0.1) -> int:
        """Read once and take the experiment's samples; how many it took."""
        if self.reader is None:
            return 0
        chunk = self.reader.read(timeout_s)
        if len(chunk):
            self.acc.update(chunk.arm, chunk.score, chunk.label, chunk.ts, chunk.request)
        return len(chunk)

    def look(self) -> WatchReport | None:
        """Follow the record, compute the figures and the verdicts, act on them with --auto, and
        publish the look (``latest``, the report file). None: no experiment to watch."""
        exp = self._follow()
        if exp is None or self.reader is None:
            return None
        sums = dict(self.acc.sums)
        control = sums.get(ex.CONTROL, ArmSums())
        rule = [RuleLine.of(arm, decide(control, sums.get(arm, ArmSums()), self.rule))
                for arm in (candidates(exp) if exp.running else [])]  # fmt: skip
        arms = [ArmLine.of(r) for r in self.acc.report().values()]
        self._tell(exp, rule)
        if self.cfg.auto and exp.running:
            exp = self._act(exp, rule)
        report = WatchReport(exp.name, exp.state, time.time(), self.cfg.window_s, self.cfg.auto,
                             replace(self.reader.counts), arms, rule)  # fmt: skip
        self.latest = report
        try:
            write_report(self.root, self.model, report)
        except OSError as e:
            log.error("experiment watch: cannot write the report: %s", e)
        return report

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def _follow(self) -> ex.Experiment | None:
        try:
            exp = ex.read_experiment(self.root, self.model)
        except ex.ExperimentError as e:
            self.record_errors += 1
            log.warning("experiment watch: %s (keeping the last good record)", e)
            exp = self.exp
        if exp is None:
            return None
        if self.exp is None or (exp.name, exp.started) != (self.exp.name, self.exp.started):
            self.close()
            self.acc, self._said, self._given_up = ArmsAccumulator(self.cfg.window_s), {}, set()
            self.reader = SampleReader(self.cfg, span_of(exp))
            log.info("experiment watch: %s (%s): arms %s, from %s", exp.name, exp.state, ", ".join(span_of(exp).arms),
                     time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(exp.started)))  # fmt: skip
        else:
            self._narrow(exp)
        self.exp = exp
        return exp

    def _narrow(self, exp: ex.Experiment) -> None:
        """Once ``exp`` ended, read no later samples and forget those read before the end was
        known (an operator's stop, promotion or abort between two looks): counted as foreign."""
        if self.reader is None or self.reader.span.ended == exp.ended:
            return
        self.reader.span = span_of(exp)
        if exp.ended is not None and (late := self.acc.drop_after(exp.ended)):
            self.reader.counts.kept -= late
            self.reader.counts.foreign += late
            log.info("experiment watch: %s ended: %d samples scored after its end forgotten", exp.name, late)

    def _tell(self, exp: ex.Experiment, rule: list[RuleLine]) -> None:
        """Log each verdict that changed."""
        for line in rule:
            if self._said.get(line.arm) == line.verdict:
                continue
            self._said[line.arm] = line.verdict
            e = line.typed()
            acted = "" if self.cfg.auto or line.verdict == "continue" else " (not acted on: --auto is off)"
            log.info("experiment %s: arm %s: %s%s -- %s (%s %.4g vs control %.4g, statistic %.3f of %.3f, n %d/%d)",
                     exp.name, line.arm, line.verdict, acted, "; ".join(e.reasons), e.metric, e.candidate_mean,
                     e.control_mean, e.statistic, e.threshold, e.n_candidate, e.n_control)  # fmt: skip

    def _act(self, exp: ex.Experiment, rule: list[RuleLine]) -> ex.Experiment:
        """Aborts first, then at most one promotion; the record the last change left."""
        lines = [r for r in rule if r.arm not in self._given_up]
        aborts = [r for r in lines if r.verdict == "abort"]
        promotes = sorted((r for r in lines if r.verdict == "promote"), key=lambda r: -r.typed().statistic)
        for line in [*aborts, *promotes[:1]]:
            change, done = (ex.abort, ex.ABORTED) if line.verdict == "abort" else (ex.promote, ex.PROMOTED)
            try:
                exp = change(self.root, self.model, line.arm, by="rule", evidence=line.evidence)
            except ModelStoreError as e:
                self.refusals += 1
                self._given_up.add(line.arm)
                log.error(
                    "experiment %s: the rule's %s of arm %s was refused: %s",
                    exp.name,
                    line.verdict,
                    line.arm,
                    e,
                )
                continue
            self.actions[(line.arm, done)] = self.actions.get((line.arm, done), 0) + 1
            log.info(
                "experiment %s: arm %s %s by the rule (%s)",
                exp.name,
                line.arm,
                done,
                "; ".join(line.typed().reasons),
            )
        self.exp = exp
        self._narrow(exp)  # ended now: read no later samples
        return exp
