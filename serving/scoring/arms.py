"""A running experiment as a scoring process serves it: each request goes to its arm's scorer.

The experiment record (``model_store.experiments``) is followed beside CURRENT by
``serving.scoring.experiments.ArmsFollower``, which loads one ``Scorer`` per arm version and
publishes them as one ``Split``; ``Router`` takes each request to the scorer that serves it:

1. no experiment runs: CURRENT's scorer, the response as it always was (no ``arm`` field);
2. a running one: the request's unit key (``Unit``) picks its arm (``experiments.assign``, the one
   assignment of every process and host); the request is decoded, looked up, scored and encoded by
   that arm's scorer only, so it never mixes versions, and its response's ``versions`` (and so its
   impression, ``serving.scoring.impressions``) gain ``"arm"`` and ``"experiment"``;
3. once its arm has looked it up, the request's body is offered to the shadow arms
   (``serving.scoring.shadow``: scored off the response path by one background thread, dropped
   and counted when its queue is full).

A request's unit key: with ``Experiment.unit_key`` '' its request id (``X-Request-Id``, the
client's or a new one); else the sign (``features.hashing``, as a decimal string) of that sparse
slot's value in the request's first row -- for a context slot, the request's one value -- so a
JSON request in any form and a binary compact batch with the same value have the same unit, and
a unit can be recomputed from an impression's batch. A request without a value for it (the sign
a missing value hashes to, or an empty multi-valued row) falls back to its request id. A record
whose unit key names no sparse slot of the schema is refused (``ArmsFollower``).

To read a slot's value the request is decoded once with control's decoder; an arm whose schema
(fitted statistics included) differs from control's decodes it again, with its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from features.batch import CompactBatch
from features.schema import Schema
from model_store.experiments import CONTROL, Experiment, ExperimentError, assign
from serving.scoring.core import Scorer
from serving.scoring.decoding import Request
from serving.scoring.errors import Unavailable
from serving.scoring.loop import Outcome, Pending, Started, Stopwatch, complete, looked_up, prepare, stamped
from serving.scoring.shadow import ShadowArm, Shadows

if TYPE_CHECKING:
    from serving.scoring.impressions import ImpressionLog


def first_sign(batch: CompactBatch, slot: int) -> int | None:
    """The sign of sparse slot ``slot``'s first value in the batch's first row (None: no value)."""
    view = batch.slot(slot)
    if view.offsets is not None:  # multi-valued: row 0's values are offsets[0]:offsets[1]
        lo, hi = int(view.offsets[0]), int(view.offsets[1])
        return int(view.signs[view.values[lo]]) if hi > lo else None
    return int(view.signs[view.values[0]]) if len(view.values) else None


class Unit:
    """Where a request's unit key comes from (``Experiment.unit_key`` read against ``schema``)."""

    def __init__(self, unit_key: str, schema: Schema):
        self.name = unit_key
        self.slot = -1  # the request id
        self.missing: int | None = None
        if not unit_key:
            return
        names = [f.name for f in schema.sparse]
        columns = [getattr(f, "column", "") or f.name for f in schema.sparse]
        if unit_key not in names and unit_key not in columns:
            raise ExperimentError(f"unit key {unit_key!r} is no sparse slot of schema {schema.name!r} "
                                  f"(slots: {', '.join(names)}; '' keys units by request id)")  # fmt: skip
        self.slot = names.index(unit_key) if unit_key in names else columns.index(unit_key)
        from features.transform import transform

        try:  # the sign a request without the field gets: such a request falls back to its id
            self.missing = first_sign(transform([{}], schema), self.slot)
        except Exception:  # noqa: BLE001 - a required slot: a request without it is refused anyway
            self.missing = None

    def key(self, request: Request, rid: str) -> str:
        """The unit key of a decoded request with request id ``rid``."""
        sign = first_sign(request.batch, self.slot)
        return rid if sign is None or sign == self.missing else str(sign)


@dataclass(frozen=True)
class Split:
    """A running experiment as served: its record and one scorer per arm (in ``experiment.arms``'
    order; two arms of one version share one scorer)."""

    experiment: Experiment
    scorers: tuple[Scorer, ...]
    unit: Unit
    control: int
    """The index of control's arm."""
    shadows: tuple[ShadowArm, ...]
    redecode: tuple[bool, ...]
    """Per arm: its schema is not control's, so it decodes the request itself."""
    stamps: tuple[dict[str, Any], ...]
    """Per arm: what its responses' ``versions`` gain (a shadow's: ``"shadow": true`` too, which
    sends its impressions to the shadow topic)."""

    @classmethod
    def of(cls, experiment: Experiment, scorers: list[Scorer]) -> Split:
        """Refused (ExperimentError) when its unit key names no sparse slot of control's schema."""
        names = experiment.names()
        control = scorers[names.index(CONTROL)]
        stamps = tuple({"arm": a.name, "experiment": experiment.name, **({"shadow": True} if a.shadow else {})}
                       for a in experiment.arms)  # fmt: skip
        shadows = tuple(ShadowArm(a.name, s, stamp) for a, s, stamp in zip(experiment.arms, scorers, stamps, strict=True)
                        if a.shadow)  # fmt: skip
        return cls(experiment, tuple(scorers), Unit(experiment.unit_key, control.schema), names.index(CONTROL),
                   shadows, tuple(s.schema != control.schema for s in scorers), stamps)  # fmt: skip

    def arm_of(self, key: str) -> int:
        """The index of the arm that serves unit ``key`` (never a shadow)."""
        return int(assign(np.array([key]), self.experiment)[0])

    def route(self, body: bytes, content_type: str | None, rid: str, log: ImpressionLog | None) -> tuple[Scorer, Started]:  # fmt: skip
        """The scorer of the request's arm and the request prepared by it alone, stamped with its arm."""
        if self.unit.slot < 0:  # by request id: known before decoding
            i = self.arm_of(rid)
            return self.scorers[i], stamped(
                prepare(self.scorers[i], body, content_type, rid, log), self.stamps[i]
            )
        control, watch = self.scorers[self.control], Stopwatch()
        try:
            with watch.stage("decode"):
                request = control.decode(body, content_type)
            i = self.arm_of(self.unit.key(request, rid))
            if self.redecode[i]:
                with watch.stage("decode"):
                    request = self.scorers[i].decode(body, content_type)
        except Exception as e:
            return control, watch.failed(e)
        return self.scorers[i], stamped(looked_up(self.scorers[i], request, watch, rid, log), self.stamps[i])


class Served(Protocol):
    """What a router reads of the follower of the store (``serving.scoring.follow.ScorerFollower``)."""

    @property
    def scorer(self) -> Scorer | None: ...
    @property
    def split(self) -> Split | None: ...
    def not_serving_reason(self) -> str: ...


class Router:
    """Takes each request of a frontend to the scorer that serves it: the follower's (CURRENT's),
    or its arm's while an experiment runs (``ScorerFollower.split``), and offers it to the
    experiment's shadow arms. Both frontends route through one (the lean one per request, the
    TorchServe handler per request of its batch)."""

    def __init__(self, follower: Served, log: ImpressionLog | None = None, shadow_capacity: int = 64):
        self.follower, self.log = follower, log
        self.shadows: Shadows = Shadows(log, shadow_capacity)

    def prepare(self, body: bytes, content_type: str | None, rid: str) -> tuple[Scorer | None, Started]:
        """The scorer that takes the request (None while nothing is served: a 503 naming why) and
        the request decoded and looked up by it, or the Outcome that ends it."""
        scorer, split = self.follower.scorer, self.follower.split
        if scorer is None:
            why = Unavailable(self.follower.not_serving_reason())
            return None, Outcome(None, why, {}, {"total": 0.0})
        if split is None:
            return scorer, prepare(scorer, body, content_type, rid, self.log)
        chosen, started = split.route(body, content_type, rid, self.log)
        if split.shadows and isinstance(started, Pending):
            self.shadows.offer(split.shadows, body, content_type, rid)
        return chosen, started

    def run(self, body: bytes, content_type: str | None, rid: str) -> tuple[Scorer | None, Outcome]:
        """One request through every verb, alone, by the scorer that takes it."""
        scorer, started = self.prepare(body, content_type, rid)
        return scorer, started if isinstance(started, Outcome) else complete([started])[0]

    def close(self) -> None:
        self.shadows.close()


def arm_of(versions: dict[str, Any]) -> str:
    """The arm a reply's versions name ('' outside an experiment)."""
    return str(versions.get("arm", ""))
