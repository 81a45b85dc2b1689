"""What a serving component follows: the version of a model it should serve, and what it refused.

The PS follower (``serving.ps.follow``), the controller (``serving.stack.controller``) and the lean
frontend (``serving.scoring.lean``) each poll the model store and switch versions. What they share
is this one object: the *target* is the pinned version, or the one ``CURRENT`` names; a version
(or a delta of one) that the gate or a load refuses is final -- logged once, counted once in
``recserve_version_refusals_total{component, kind}`` and never tried again -- and why the target is
not served is worded one way everywhere (``not_serving``)."""

from __future__ import annotations

import logging
from pathlib import Path

import model_store as ms

log = logging.getLogger("recserve.versions")


class VersionTarget:
    """The version ``component`` should serve of ``model`` in the store at ``root``."""

    def __init__(self, root: str | Path, model: str, component: str, pin: str = "", registry=None):
        self.root, self.model, self.component, self.pin = Path(root), model, component, pin
        self.refused: dict[tuple[str, int], str] = {}
        """(version, delta seq; -1 for the version itself) -> why it was refused."""
        self.refusals = None
        if registry is not None:
            from serving.rpc.metrics import version_refusals

            self.refusals = version_refusals(registry, component)

    def target(self) -> str | None:
        """The pinned version, or the one CURRENT names (None: nothing published yet)."""
        return self.pin or ms.current(self.root, self.model)

    def wanted(self, target: str | None, served: str | None) -> bool:
        """Whether to switch to ``target``: there is one, it is not what is served, not refused."""
        return bool(target) and target != served and (target, -1) not in self.refused

    def is_refused(self, version: str, seq: int = -1) -> bool:
        return (version, seq) in self.refused

    def refuse(self, version: str, why: str, seq: int = -1) -> None:
        """Refuse ``version`` (or its delta ``seq``) for good: logged and counted the first time."""
        if (version, seq) in self.refused:
            return
        log.error("%s: %s", self.component, why)
        self.refused[(version, seq)] = why
        if self.refusals is not None:
            self.refusals.labels(self.component, "version" if seq == -1 else "delta").inc()

    def refusal(self, target: str | None, served: str | None) -> str:
        """Why ``target`` is not served when that is final ('' when it is served or not refused)."""
        return self.refused.get((target, -1), "") if target and target != served else ""

    def not_serving(self, target: str | None, failure: str = "") -> str:
        """Why nothing is served yet: the target's refusal, the last failure to load it, or that it
        is not loaded yet, or that no version is published."""
        if target and (why := self.refused.get((target, -1))):
            return why
        if failure:
            return failure
        if target:
            return f"version {target} of model {self.model} not loaded yet"
        return f"no version published yet for model {self.model} in {self.root}"
