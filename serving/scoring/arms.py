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

What the split adds to a request is kept to constant work in its thread (a request spent about
90 us of CPU more with a split than without, on a 2-vCPU VM, 200 items, all three arms one scorer:
``assign`` building numpy arrays for one key, ``CompactBatch.slot`` and ``dataclasses.replace``):
the unit's slot value is read in place (``first_sign``), its arm by ``Assignment`` (``assign``'s
arithmetic for one key, its constants computed once per split) and the stamp added to the
request's own versions (``loop.stamped``). An arm's scorer is new when the experiment starts:
``serving.scoring.experiments`` warms it with the process's recent requests before the split
serves (``Router.recent``).
"""

from __future__ import annotations

import threading
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import xxhash

from features.batch import FLAG_MULTI, CompactBatch
from features.schema import Schema
from model_store.experiments import CONTROL, Experiment, ExperimentError, salt_seed
from serving.scoring.core import Scorer
from serving.scoring.decoding import Request
from serving.scoring.errors import Unavailable
from serving.scoring.loop import Outcome, Pending, Started, Stopwatch, complete, looked_up, prepare, stamped
from serving.scoring.shadow import ShadowArm, Shadows

if TYPE_CHECKING:
    from serving.scoring.impressions import ImpressionLog


def first_sign(batch: CompactBatch, slot: int) -> int | None:
    """The sign of sparse slot ``slot``'s first value in the batch's first row (None: no value)."""
    if batch.flags[slot] & FLAG_MULTI:  # multi-valued: row 0's values are offsets[0]:offsets[1]
        view = batch.slot(slot)
        assert view.offsets is not None
        lo, hi = int(view.offsets[0]), int(view.offsets[1])
        return int(view.signs[view.values[lo]]) if hi > lo else None
    if not batch.value_counts[slot]:
        return None
    # ``batch.slot(slot)``'s signs[values[0]], read in place (no views, no cumulative sums)
    first = int(batch.value_counts[:slot].sum()) if slot else 0
    base = int(batch.sign_counts[:slot].sum()) if slot else 0
    return int(batch.signs[base + int(batch.values[first])])


class Assignment:
    """``model_store.experiments.assign`` for one unit key at a time, over one running
    experiment's record: the same arm for every key, by the same arithmetic (XXH64 of the key's
    UTF-8 bytes seeded by ``salt_seed(salt)``, its top 53 bits placed among the candidates'
    slices), with the seed and the slices computed once, here, rather than per request (``assign``
    builds numpy arrays for a batch of keys: some 10-50 us for one). Keys with a NUL at their end
    hash as ``assign``'s numpy strings do, without it."""

    def __init__(self, experiment: Experiment):
        if not experiment.running:
            raise ExperimentError(f"experiment {experiment.name!r} is {experiment.state}: it assigns no unit")
        index = {a.name: i for i, a in enumerate(experiment.arms)}
        slices = sorted(
            (a for a in experiment.arms if a.name != CONTROL and not a.shadow), key=lambda a: a.offset
        )
        self.seed = salt_seed(experiment.salt)
        self.edges = [float(x) for a in slices for x in (a.offset, a.offset + a.share)]
        self.owner = [index[CONTROL]] * (2 * len(slices) + 1)  # between slices: control
        self.owner[1::2] = [index[a.name] for a in slices]

    def __call__(self, key: str) -> int:
        """The index in the record's arms of the arm serving unit ``key`` (never a shadow)."""
        h = xxhash.xxh64_intdigest(key.rstrip("\0").encode("utf-8", "surrogatepass"), self.seed)
        return self.owner[bisect_right(self.edges, (h >> 11) * 2.0**-53)]


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
    assignment: Assignment
    """The arm of a unit key (``assign``, one key at a time)."""

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
                   shadows, tuple(s.schema != control.schema for s in scorers), stamps, Assignment(experiment))  # fmt: skip

    def arm_of(self, key: str) -> int:
        """The index of the arm that serves unit ``key`` (never a shadow)."""
        return self.assignment(key)

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


RECENT = 8
"""Request bodies a router keeps (``Router.recent``): a new arm's scorer is warmed with them."""


def warm(scorer: Scorer, requests: list[tuple[bytes, str | None]]) -> int:
    """Run ``requests`` through every verb of ``scorer`` (each alone; scores dropped, failures
    ignored: a request the version refuses warms nothing), before it serves: the first requests
    of a real size meet a dense runtime that ran that shape (TorchScript's first call at a new
    batch shape took 2-6 ms against 0.3-0.4 ms; its warm-up runs one-row requests) and rows mapped
    in. Returns how many were scored."""
    done = 0
    for body, content_type in requests:
        try:
            inputs = scorer.lookup(scorer.decode(body, content_type))
            scorer.encode(scorer.predict([inputs])[0], inputs.versions)
            done += 1
        except Exception:  # noqa: BLE001 - a warm-up: the request itself gets its answer when it comes
            continue
    return done


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

    def __init__(self, follower: Served, log: ImpressionLog | None = None, shadow_capacity: int = 64,
                 keep_recent: int = RECENT) -> None:  # fmt: skip
        self.follower, self.log = follower, log
        self.shadows: Shadows = Shadows(log, shadow_capacity)
        self._recent: deque[tuple[bytes, str | None]] = deque(maxlen=keep_recent)
        self._recent_lock = threading.Lock()
        arms = getattr(follower, "arms", None)  # a ScorerFollower's ArmsFollower: new arms warm on these
        if arms is not None:
            arms.recent = self.recent

    def recent(self) -> list[tuple[bytes, str | None]]:
        """The bodies (and content types) of the last requests this router took, oldest first (at
        most ``keep_recent``): what a scorer about to serve them is warmed with."""
        with self._recent_lock:
            return list(self._recent)

    def prepare(self, body: bytes, content_type: str | None, rid: str) -> tuple[Scorer | None, Started]:
        """The scorer that takes the request (None while nothing is served: a 503 naming why) and
        the request decoded and looked up by it, or the Outcome that ends it."""
        scorer, split = self.follower.scorer, self.follower.split
        if scorer is None:
            why = Unavailable(self.follower.not_serving_reason())
            return None, Outcome(None, why, {}, {"total": 0.0})
        with self._recent_lock:
            self._recent.append((body, content_type))
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
