"""The one request loop of both scoring frontends (LitServe's ``loops``): a request's verbs in
order -- decode, lookup, then predict and encode -- singly (``run``) or with the dense stage shared
by several requests (``prepare`` each, then ``complete`` them together: TorchServe's batch in the
handler, a micro-batch of ``serving.scoring.batching`` in ``recserve serve``).

Each request ends as an ``Outcome``: its encoded scores, or the exception that stopped it (never
raised from here: one request's failure is its own), and the time of each stage. Timing is the
loop's ``Stopwatch`` around each verb, not bookkeeping in the verbs. What an error answers is the
frontend's to say, at its boundary (``reply_of``, by ``serving.scoring.errors``' one table).

A scored request is offered, once, after its encode, to the frontend's impression log when it
has one (``serving.scoring.impressions``): the hook both frontends share.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from serving.scoring.core import Inputs, Scorer
from serving.scoring.decoding import Request
from serving.scoring.errors import Reply, error_body, status_of

if TYPE_CHECKING:
    from serving.scoring.impressions import ImpressionLog


@dataclass(frozen=True)
class Outcome:
    """What the loop made of one request: its JSON body (scored) or its error, the versions that
    answered (empty unless scored; a failed request of an experiment names its arm) and each
    stage's wall time in ms (``total`` always)."""

    payload: bytes | None
    error: Exception | None
    versions: dict[str, Any]
    timings: dict[str, float]


@dataclass
class Stopwatch:
    """The stage times of one request, from its start (the timing hook the loop runs each verb in)."""

    t0: float = field(default_factory=time.perf_counter)
    ms: dict[str, float] = field(default_factory=dict)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        yield
        self.ms[name] = (time.perf_counter() - t) * 1e3

    def scored(self, payload: bytes, versions: dict[str, Any]) -> Outcome:
        return Outcome(payload, None, versions, {**self.ms, "total": self._total()})

    def failed(self, e: Exception) -> Outcome:
        """A request that failed at any stage says only how long it took."""
        return Outcome(None, e, {}, {"total": self._total()})

    def _total(self) -> float:
        return (time.perf_counter() - self.t0) * 1e3


@dataclass(frozen=True)
class Pending:
    """A request decoded and looked up by ``scorer``, waiting for its dense stage (and, once
    scored, for ``log`` when the frontend logs impressions)."""

    scorer: Scorer
    request: Request
    inputs: Inputs
    watch: Stopwatch
    request_id: str = ""
    log: ImpressionLog | None = None

    @property
    def items(self) -> int:
        return len(self.inputs.pooled)


Started = Pending | Outcome
"""A request decoded and looked up, or the Outcome that ended it on the way."""


def stamped(started: Started, stamp: dict[str, Any]) -> Started:
    """``started`` with ``stamp`` in its versions (an experiment's arm: the response's, the
    impression's; a failure's too). A looked-up request's versions are its own (a new dict per
    ``Scorer.lookup``): they gain the stamp in place, no copy of the request on its path."""
    if isinstance(started, Pending):
        started.inputs.versions.update(stamp)
        return started
    return replace(started, versions={**started.versions, **stamp})


def prepare(scorer: Scorer, body: bytes, content_type: str | None, request_id: str = "",
            log: ImpressionLog | None = None) -> Pending | Outcome:  # fmt: skip
    """Decode and look up one request: what its dense stage needs, or the Outcome that ends it."""
    watch = Stopwatch()
    try:
        with watch.stage("decode"):
            request = scorer.decode(body, content_type)
    except Exception as e:
        return watch.failed(e)
    return looked_up(scorer, request, watch, request_id, log)


def looked_up(scorer: Scorer, request: Request, watch: Stopwatch, request_id: str = "",
              log: ImpressionLog | None = None) -> Pending | Outcome:  # fmt: skip
    """Look up a decoded request (``prepare``'s second half: a request decoded already, to read
    its experiment's unit key, ``serving.scoring.arms``)."""
    try:
        with watch.stage("worker"):
            inputs = scorer.lookup(request)
    except Exception as e:
        return watch.failed(e)
    return Pending(scorer, request, inputs, watch, request_id, log)


def complete(run: Sequence[Pending]) -> list[Outcome]:
    """The Outcomes of requests ``prepare``d by one scorer, after ONE dense run over them all, in
    order; each is the Outcome the request gets alone. A failed dense run is every request's."""
    if not run:
        return []
    scorer = run[0].scorer
    if any(p.scorer is not scorer for p in run):
        raise ValueError("a dense run takes the requests of one scorer (version)")
    t0 = time.perf_counter()
    try:
        scores = scorer.predict([p.inputs for p in run])
    except Exception as e:
        return [p.watch.failed(e) for p in run]
    dense_ms = (time.perf_counter() - t0) * 1e3
    out = []
    for p, s in zip(run, scores, strict=True):
        p.watch.ms["dense"] = dense_ms  # the run's: every request of it waited for all of it
        try:
            with p.watch.stage("encode"):
                payload = scorer.encode(s, p.inputs.versions)
        except Exception as e:
            out.append(p.watch.failed(e))
            continue
        if p.log is not None:  # off the request path: a queue append
            p.log.offer(p.request_id, p.request, s, p.inputs.versions)
        out.append(p.watch.scored(payload, p.inputs.versions))
    return out


def complete_each(run: Sequence[Pending]) -> list[Outcome]:
    """``complete`` for requests ``prepare``d by several scorers (an experiment's arms): one dense
    run per scorer, the Outcomes in the requests' order."""
    groups: dict[int, list[int]] = {}
    for i, p in enumerate(run):
        groups.setdefault(id(p.scorer), []).append(i)
    out: list[Outcome | None] = [None] * len(run)
    for idx in groups.values():
        for i, outcome in zip(idx, complete([run[i] for i in idx]), strict=True):
            out[i] = outcome
    return [o for o in out if o is not None]


def run(scorer: Scorer, body: bytes, content_type: str | None, request_id: str = "",
        log: ImpressionLog | None = None) -> Outcome:  # fmt: skip
    """One request through every verb, alone."""
    pending = prepare(scorer, body, content_type, request_id, log)
    return pending if isinstance(pending, Outcome) else complete([pending])[0]


def score(scorer: Scorer, body: bytes, content_type: str | None) -> Reply:
    """``run`` answered as a frontend would: for callers in this process (tests, benchmarks)."""
    return reply_of(run(scorer, body, content_type))


def reply_of(outcome: Outcome) -> Reply:
    """The Reply of what the request loop made of one request: its scores, or its error's status."""
    if outcome.error is None:
        assert outcome.payload is not None
        return Reply(200, outcome.payload, outcome.timings, outcome.versions)
    status, message = status_of(outcome.error)
    return Reply(status, error_body(message), outcome.timings, outcome.versions)  # an arm's, else {}
