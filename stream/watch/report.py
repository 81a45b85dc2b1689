"""What the watcher saw at its latest look, ``WatchReport``: the typed record /metrics shows and
``<store>/<model>/EXPERIMENT.metrics.json`` holds (one writer, ``write_report``, atomic; one
reader, ``read_report``, refusing another format or a malformed file by name with ``ReportError``),
so ``recserve experiment status`` prints the figures and the verdicts the role would act on."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from model_store import layout as ms
from model_store.errors import RecordError
from model_store.records import decode
from model_store.releases import Root
from stream.arms import ArmMetrics, ArmReport
from stream.sequential import Decision, Evidence
from stream.watch.reader import ReadCounts

FORMAT = "recserve-experiment-metrics/1"
NAME = "EXPERIMENT.metrics.json"


class ReportError(ValueError):
    """A metrics report that cannot be read (malformed, another format); the message names the file."""


@dataclass(frozen=True)
class ArmLine:
    """One arm's figures: since the experiment's start and over the sliding window."""

    arm: str
    cumulative: ArmMetrics
    window: ArmMetrics

    @classmethod
    def of(cls, report: ArmReport) -> ArmLine:
        return cls(str(report.arm), report.cumulative, report.window)


@dataclass(frozen=True)
class RuleLine:
    """The rule's verdict on one candidate against control at the look, and its evidence."""

    arm: str
    verdict: str
    """continue | promote | abort"""
    evidence: dict[str, Any]
    """``stream.sequential.Evidence`` as a dict (what a decision records): ``typed`` reads it."""

    @classmethod
    def of(cls, arm: str, decision: Decision) -> RuleLine:
        evidence = asdict(decision.evidence)
        return cls(
            arm, decision.verdict.value, {**evidence, "reasons": list(evidence["reasons"])}
        )  # as JSON has it

    def typed(self) -> Evidence:
        return Evidence(**{**self.evidence, "reasons": tuple(self.evidence["reasons"])})


@dataclass(frozen=True)
class WatchReport:
    """``EXPERIMENT.metrics.json``: one look of the watcher at one experiment."""

    experiment: str
    state: str
    """The experiment's state at the look (running | stopped | promoted | aborted)."""
    at: float
    """When the look was taken (seconds since the epoch)."""
    window_s: float
    auto: bool
    """Whether the watcher acts on the verdicts (--auto)."""
    counts: ReadCounts
    arms: list[ArmLine] = field(default_factory=list)
    rule: list[RuleLine] = field(default_factory=list)
    """One line per candidate still in the running experiment (none once it ended)."""
    format: str = FORMAT

    def arm(self, name: str) -> ArmLine | None:
        return next((a for a in self.arms if a.arm == name), None)


def path_of(root: Root, model: str) -> Path:
    return ms.model_dir(root, model) / NAME


def write_report(root: Root, model: str, report: WatchReport) -> None:
    """Replace the model's report atomically (a reader sees the last one or this one)."""
    ms.write_atomic(path_of(root, model), json.dumps(asdict(report), indent=1, sort_keys=True).encode())


def read_report(root: Root, model: str) -> WatchReport | None:
    """The model's latest report (None: no watcher wrote one), or ReportError naming the problem."""
    path = path_of(root, model)
    try:
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ReportError(f"{path}: not an experiment metrics report: {e}") from None
    where = str(path)
    try:
        report = decode(WatchReport, raw, "experiment metrics report", where)
        return replace(
            report,
            arms=[decode(ArmLine, a, "report arm", where) for a in report.arms],
            rule=[decode(RuleLine, r, "report rule line", where) for r in report.rule],
        )
    except RecordError as e:
        raise ReportError(str(e)) from None
