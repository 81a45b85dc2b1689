"""A scoring process follows its model's experiment record (``<model>/EXPERIMENT``,
``model_store.experiments``) as it follows CURRENT: ``ArmsFollower`` owns the ``Split`` the
process serves (``serving.scoring.arms``), None while no experiment runs.

``ScorerFollower.step`` runs one ``step`` after its own (at each notice of a new CURRENT and every
``poll_s``: the record has no notice of its own):

1. read the record (``read_experiment``: the one reader, which checks it and each arm's version
   beside control's); none, or one that ended (stopped, promoted, aborted): drop the split, so
   every request goes to CURRENT's scorer again;
2. the record served already, or refused before: nothing to do;
3. one scorer per arm version: CURRENT's when it serves that version, one loaded before for this
   experiment, else a new ``Scorer`` (mapping its co-located shards, which follow that version's
   deltas as CURRENT's do; warming up until every remote shard holds it), then warmed with the
   process's recent requests (``recent``: its router's, ``serving.scoring.arms.warm``), so the
   arm's first requests meet a dense runtime that ran their shape and rows already mapped in;
4. the new split replaces the old in one reference assignment (``on_split`` is told);
5. scorers no arm uses any more keep their resources ``drain_s`` for requests that took them,
   then are closed.

A record that does not read (malformed, another format, shares over 100%, a version the gate
refuses beside control), whose unit key names no slot, or one of whose versions does not load (a
``ModelStoreError`` or ``ValueError``), is refused: logged and counted once
(``recserve_version_refusals_total{component="scorer", kind="experiment"}``, ``on_refuse``), and
the process stays on the last good record it serves; any other failure (a remote shard not
holding a version yet) is tried again at the next step. A scorer that CURRENT's follower replaces
while an arm still uses it is handed over here (``adopt``) and closed when no arm does; when
CURRENT moves to a version an arm serves (a promotion), that arm's scorer is handed to CURRENT's
follower (``take``) rather than loaded twice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import model_store as ms
from model_store.experiments import Experiment, ExperimentError, read_experiment
from serving.scoring.arms import Split, warm
from serving.scoring.core import Scorer

if TYPE_CHECKING:
    from serving.notices import Notices
    from serving.scoring.config import ScoringConfig

log = logging.getLogger("recserve.serve")
KIND = "experiment"
"""The kind label of a refused experiment record (``recserve_version_refusals_total``)."""


def mapped_bytes(scorer: Scorer) -> int:
    """Bytes of embedding rows ``scorer`` holds in this process: its co-located shards' tables
    (mapped base and delta overlay); 0 for shards read remotely."""
    shards = getattr(scorer.lookups.worker, "shards", [])
    return sum(int(s.store.memory_bytes) for s in shards if getattr(s, "local", False))


class ArmsFollower:
    """The split a scoring process serves of ``model``'s running experiment (None: none runs)."""

    def __init__(self, store: str, model: str, scoring: ScoringConfig, notices: Notices | None = None,
                 drain_s: float = 2.0, refusals: Any = None, component: str = "scorer") -> None:  # fmt: skip
        """``refusals``: the process's ``recserve_version_refusals_total`` counter (None: not counted)."""
        self.store, self.model, self.scoring, self.notices, self.drain_s = (
            store,
            model,
            scoring,
            notices,
            drain_s,
        )
        self.split: Split | None = None
        self.failure = ""  # why the last load of an arm failed (retried)
        self.on_split: Callable[[Split | None], None] = lambda split: None
        """Told of each split as it starts serving, and None when the experiment ends."""
        self.on_refuse: Callable[[str], None] = lambda why: None
        """Told of each record refused, with why (besides the log and ``refusals``)."""
        self.recent: Callable[[], list[tuple[bytes, str | None]]] = lambda: []
        """The process's recent requests (body, content type), each new arm scorer's warm-up
        (``serving.scoring.arms.Router`` sets its own)."""
        self.refused: dict[str, str] = {}
        """A refused record (its error, or its repr when it read) -> why."""
        self._owned: dict[str, Scorer] = {}  # version -> a scorer loaded here (or adopted), closed here
        self._counter = refusals.labels(component, KIND) if refusals is not None else None
        if self._counter is not None:
            self._counter.inc(0)  # the series exists (at 0) from the start

    def step(self, current: Scorer | None) -> None:
        """One poll (blocking; on the follower's thread): serve what the record says beside
        ``current`` (CURRENT's scorer; nothing while it is None: requests get a 503 anyway)."""
        if current is None:
            return
        try:
            exp = read_experiment(self.store, self.model)
        except ExperimentError as e:
            return self._refuse(str(e), str(e))
        if exp is None or not exp.running:
            if self.split is not None:
                log.info("experiment %s %s: every request to CURRENT (%s)", self.split.experiment.name,
                         exp.state if exp else "removed", current.dense_version)  # fmt: skip
                self._switch(None)
            return
        if self.split is not None and exp == self.split.experiment or repr(exp) in self.refused:
            return
        try:
            split = self._load(exp, current)
        except (ms.ModelStoreError, ValueError) as e:  # final for this record (ExperimentError among them)
            return self._refuse(repr(exp), f"experiment {exp.name!r} refused: {e}")
        except Exception as e:  # a remote shard not holding a version yet, ...: tried again
            self.failure = f"experiment {exp.name!r} not loaded: {e}"
            log.warning("%s", self.failure)
            return
        self.failure = ""
        self._switch(split)
        log.info("serving experiment %s: %s (units by %s)", exp.name,
                 ", ".join(f"{a.name}={a.version}" + (" shadow" if a.shadow else f" {a.share:.1%}") for a in exp.arms),
                 exp.unit_key or "request id")  # fmt: skip

    def _load(self, exp: Experiment, current: Scorer) -> Split:
        """A scorer per arm version (CURRENT's, one held here, or a new one) and the split of them."""
        have = {**self._owned, current.dense_version: current}
        new: dict[str, Scorer] = {}
        try:
            for arm in exp.arms:
                if arm.version not in have and arm.version not in new:
                    vdir = ms.version_dir(self.store, self.model, arm.version)
                    new[arm.version] = Scorer(
                        replace(self.scoring, version_dir=str(vdir)), notices=self.notices
                    )
            have.update(new)
            split = Split.of(exp, [have[a.version] for a in exp.arms])
            if new:
                recent = self.recent()
                for scorer in new.values():
                    warm(scorer, recent)
        except BaseException:
            for scorer in new.values():
                scorer.close()
            raise
        self._owned.update(new)
        return split

    def _switch(self, split: Split | None) -> None:
        old, self.split = self.split, split
        self.on_split(split)
        used = {id(s) for s in split.scorers} if split is not None else set()
        gone = [v for v, s in self._owned.items() if id(s) not in used]
        if gone and old is not None:
            time.sleep(self.drain_s)  # requests that took a dropped arm's scorer finish with it
        for version in gone:
            self._owned.pop(version).close()

    def _refuse(self, key: str, why: str) -> None:
        """Refuse a record for good (until it changes): logged and counted the first time."""
        if key in self.refused:
            return
        self.refused[key] = why
        kept = f"; serving stays on experiment {self.split.experiment.name!r}" if self.split else ""
        log.error("scorer: %s%s", why, kept)
        if self._counter is not None:
            self._counter.inc()
        self.on_refuse(why)

    def adopt(self, scorer: Scorer) -> bool:
        """Take over ``scorer`` (one CURRENT's follower replaced) when an arm still uses it: closed
        here once none does. False: no arm uses it (its follower closes it)."""
        if self.split is None or all(s is not scorer for s in self.split.scorers):
            return False
        self._owned[scorer.dense_version] = scorer
        return True

    def take(self, version: str) -> Scorer | None:
        """Hand the scorer held here for ``version`` to CURRENT's follower (it became CURRENT: a
        promoted arm), which closes it from now on; an arm may still use it. None: none held."""
        return self._owned.pop(version, None)

    def close(self) -> None:
        """Close the scorers held here (CURRENT's is its follower's to close)."""
        self.split = None
        for scorer in self._owned.values():
            scorer.close()
        self._owned.clear()
