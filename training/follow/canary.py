"""Canary for full versions from the stream: ``recserve train --follow ... --full-every ...
--canary-share 0.1``.

A full version, once written, is not published: it passes the gate's checks that need no publish
(``model_store.validate`` against CURRENT's manifest: schema and shapes, ``--max-auc-drop`` on its
progressive AUC, so a clearly worse version never meets traffic; ``experiments.start`` then checks
every file's checksum) and becomes the candidate arm of a new experiment, ``canary-<version>``,
serving ``--canary-share`` of the units (the unit key: the request id, as ``recserve experiment
start``'s default). The experiment decides, not the trainer: ``recserve experiment watch --auto``'s
rule (or an operator) promotes it (publishes it through the gate: CURRENT moves, and the trainer
follows it as any new CURRENT) or aborts it (its units go back to control; it is dropped, and
retention may remove it later).

One canary at a time: a full version that falls due while any experiment runs on the model is put
off by one period (the trainer's window of scores restarts, so it stays bounded however long the
experiment runs). When ours has ended, the trainer logs and counts its outcome
(``recserve_follow_full_versions_total{outcome="canary_promoted|canary_dropped|canary_stopped"}``)
before the next full version.

The canary is a frozen snapshot: while it is a candidate, deltas keep going into control (the
version the trainer follows) and none into it. Promoted, the trainer follows it from that
snapshot: the rows it trained into control meanwhile are not in it (the stream is not read back).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import model_store as ms
from model_store import experiments as ex

log = logging.getLogger("recserve.train.follow")

OUTCOMES = {ex.PROMOTED: "canary_promoted", ex.ABORTED: "canary_dropped", ex.STOPPED: "canary_stopped"}
"""The counter's outcome label of each way a canary's experiment ends."""
STARTED = "canaried"
"""The counter's outcome label of a full version started as a canary."""
BY = "rule"
"""Who starts a canary in ``EXPERIMENTS.log``: not an operator, the trainer's standing rule."""


def name_of(version: str) -> str:
    """The experiment of ``version``'s canary."""
    return f"canary-{version}"


@dataclass
class Canary:
    """The full versions sent to a canary arm, one at a time, and what their experiments made of
    them (``started``, then one of ``promoted``, ``dropped``, ``stopped``)."""

    root: str
    model: str
    share: float
    max_auc_drop: float
    count: Callable[[str], None] = lambda outcome: None
    """Counts an outcome (the full versions counter's label)."""
    pending: str | None = None
    """The version whose canary runs (or ran, its end not seen yet)."""
    started: list[str] = field(default_factory=list)
    promoted: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)
    waits: int = 0
    """Full versions put off because an experiment ran."""

    def busy(self) -> bool:
        """Whether an experiment runs on the model (ours or an operator's; or its record does not
        read): the next full version waits. Ours having ended, its outcome is logged and counted."""
        try:
            exp = ex.read_experiment(self.root, self.model)
        except ex.ExperimentError as e:
            log.error("full version put off: the experiment record does not read (%s)", e)
            self.waits += 1
            return True
        if exp is not None and exp.running:
            if self.pending is None:  # a restarted trainer: a canary of ours still runs
                self.pending = next((a.version for a in exp.arms if exp.name == name_of(a.version)), None)
            log.info("full version put off by one period: experiment %r runs", exp.name)
            self.waits += 1
            return True
        if self.pending is not None:
            self._ended(self.pending, exp)
        return False

    def start(self, version: str) -> None:
        """Start ``version`` (written and sealed) as the candidate of experiment
        ``canary-<version>``; a ModelStoreError (QualityDrop, SchemaMismatch, ExperimentError, ...)
        when the gate or the store refuses it: then nothing changed."""
        served = ms.current_manifest(self.root, self.model)
        ms.validate(self.root, self.model, version, served, verify=False, max_auc_drop=self.max_auc_drop)
        ex.start(
            self.root, self.model, name_of(version), [(version, self.share)], by=BY
        )  # verifies the files
        self.pending = version
        self.started.append(version)
        self.count(STARTED)
        log.info("full version %s is a canary: experiment %s, share %g beside control (CURRENT %s)",
                 version, name_of(version), self.share, served.version if served else None)  # fmt: skip

    def _ended(self, version: str, exp: ex.Experiment | None) -> None:
        """Log and count how ``version``'s canary ended (its record, or the log's last line of it
        when another experiment has replaced the record since)."""
        self.pending = None
        name = name_of(version)
        if exp is None or exp.name != name:
            try:
                exp = next((e.record for e in reversed(ex.read_log(self.root, self.model)) if e.record.name == name), None)  # fmt: skip
            except ex.ExperimentError as e:
                log.error("canary %s: %s", version, e)
                exp = None
        if exp is None or exp.state not in OUTCOMES:
            log.error("canary %s: experiment %s is gone from the store's record and log: outcome unknown", version, name)  # fmt: skip
            return
        decision = next((d for d in reversed(exp.decisions) if d.version == version), None)
        why = f" by {decision.by} ({decision.evidence})" if decision else ""
        if exp.state == ex.PROMOTED:
            self.promoted.append(version)
            log.info("canary %s promoted%s: CURRENT -> %s", version, why, version)
        elif exp.state == ex.ABORTED:
            self.dropped.append(version)
            log.warning("canary %s aborted%s: dropped (serving stayed on control)", version, why)
        else:
            self.stopped.append(version)
            log.warning("canary %s stopped with no decision: not published", version)
        self.count(OUTCOMES[exp.state])
