"""TorchServe handler for recserve scoring: an adapter over ``serving.scoring.core.Scorer``.

TorchServe calls ``initialize(context)`` once per worker process and ``handle(data, context)``
per batch of requests (batching on): TorchServe's batch runs through the scoring core's request
loop (``serving.scoring.loop``: each request decoded and looked up, then ONE dense run), and this
is its frontend's boundary, where each request's Outcome becomes its status by the one errors
table (``serving.scoring.loop.reply_of``). Everything else -- decoding, features, the embedding
worker, the dense model -- lives in the scoring core. No import-time side effects: the core is
imported in ``initialize``.

The archive carries ``scoring.json``: a ``ScoringConfig`` (the worker address, the lookups, the
runtime and device (``"device": "cuda"``: the dense model on a GPU), limits) and what to serve,
one of two ways:

- ``"version_dir": "<store>/<model>/<version>"``: that version (and its deltas), loaded in
  ``initialize``. ``recserve up``'s controller archives one per version and switches TorchServe's
  versions itself (``serving.stack.controller``).
- ``"store": "<store>"`` (with ``"model"``, else the archive's model name; ``"version"`` to pin one;
  ``"drain_s"``, 2 by default): the worker follows that model in the store itself, as ``recserve
  serve`` does (``serving.scoring.follow.ScorerFollower``): ``initialize`` loads the version
  CURRENT names, then a daemon thread loads each newly published one (at each notice, every
  ``poll_s`` anyway) and swaps the scorer whole. ``handle`` takes one scorer per request of the
  batch, so no response mixes versions. While no version is served (none published, or the target refused
  or not loaded yet) each request gets a 503 naming why; a refused version is logged and counted
  (``recserve_version_refusals_total``) and the worker keeps serving what it has.
  components/torchserve on Kubernetes archives this form. Such a worker also serves the model's
  running experiment (``serving.scoring.arms``): each request of the batch goes to its arm's
  scorer (``Router``), the dense model runs once per arm over its requests, and shadow arms score
  off the response path.

TorchServe must run with TS_DECODE_INPUT_REQUEST=false so request bodies arrive as bytes and are
read once, in the core (serving.scoring.decoding).
"""

from __future__ import annotations

import atexit
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.scoring.arms import Router
    from serving.scoring.core import Scorer
    from serving.scoring.follow import ScorerFollower
    from serving.scoring.impressions import ImpressionLog
    from serving.torchserve.metrics import ScoringMetrics

FOLLOW_KEYS = ("store", "model", "version", "drain_s")
"""scoring.json's keys of a worker that follows a model in the store (the rest is a ScoringConfig)."""


class RecserveHandler:
    def __init__(self) -> None:
        self._pinned: Scorer | None = None
        self.follower: ScorerFollower | None = None
        """The follower of the store (scoring.json names a ``store``), else None."""
        self.router: Router | None = None
        """A follower's requests to their scorers (CURRENT's, or their arms' in an experiment)."""
        self._metrics: ScoringMetrics | None = None
        self._server_timing: Callable[[dict], str] | None = None
        self.impressions: ImpressionLog | None = None
        self.initialized = False

    @property
    def scorer(self) -> Scorer | None:
        """The served scorer (None while a follower has none): CURRENT's (a request of an experiment takes its arm's)."""
        return self.follower.scorer if self.follower is not None else self._pinned

    def initialize(self, context) -> None:
        from serving.memory import freeze_loaded
        from serving.priority import loading_priority
        from serving.scoring.config import ScoringConfig
        from serving.scoring.core import Scorer, server_timing

        self._server_timing = server_timing
        model_dir = Path(context.system_properties["model_dir"])
        raw = json.loads((model_dir / "scoring.json").read_text())
        where = {k: raw.pop(k) for k in FOLLOW_KEYS if k in raw}
        config = ScoringConfig.from_dict(raw)
        if where and ("store" not in where or config.version_dir):
            raise ValueError(f"scoring.json: {', '.join(FOLLOW_KEYS)} go with \"store\" (a model to follow), "
                             "never with \"version_dir\" (a pinned version)")  # fmt: skip
        if config.log_impressions:
            from serving.scoring.impressions import ImpressionLog

            self.impressions = ImpressionLog(config.log_impressions)
            atexit.register(self.impressions.close)  # TorchServe never calls close: deliver what is queued
        self._metrics = _metrics(context, self.impressions)
        if where:
            self._follow(where, config, context.model_name)
        else:
            with loading_priority():  # a version loading beside a serving one yields the CPU to it
                self._pinned = Scorer(config)
            freeze_loaded()  # what this worker holds for its life: out of the collector's scans
            self._switched(self._pinned)
        self.initialized = True

    def _follow(self, where: dict, config, model_name: str) -> None:
        """Serve what CURRENT names, loaded here (the worker is READY in TorchServe's management API
        once this returns: the component's readiness, serving/torchserve/ready.py), then follow the
        store on a daemon thread."""
        from serving.priority import loading_priority
        from serving.scoring.arms import Router
        from serving.scoring.experiments import KIND
        from serving.scoring.follow import COMPONENT, ScorerFollower

        follower = ScorerFollower(str(where["store"]), str(where.get("model") or model_name), config,
                                  pin=str(where.get("version", "")), drain_s=float(where.get("drain_s", 2.0)))  # fmt: skip
        follower.on_switch = self._switched
        self.router = Router(follower, self.impressions)
        if self._metrics is not None:
            metrics = self._metrics
            follower.on_refuse = lambda version, why: metrics.refused(COMPONENT)
            follower.arms.on_refuse = lambda why: metrics.refused(COMPONENT, KIND)
            follower.arms.on_split = metrics.arms
            self.router.shadows.on_reply = metrics.shadow
            metrics.shadows = self.router.shadows
        self.follower = follower
        with loading_priority():  # nothing in this worker serves yet
            follower.step()
        if follower.scorer is None:
            import logging

            logging.getLogger("recserve.handler").error("not serving yet: %s", follower.not_serving_reason())
        follower.start()

    def _switched(self, scorer: Scorer) -> None:
        """A scorer starts serving: its gauges, and the GIL's hand-over when it maps shards here."""
        from serving.priority import share_gil_with_followers

        if "colocated" in scorer.lookup_modes:  # its co-located shards' followers share the GIL
            share_gil_with_followers()
        if self._metrics is not None:
            self._metrics.serving(
                scorer.dense_version, scorer.lookup_modes, scorer.runtime, scorer.choice.device
            )

    # decode and look up each request of TorchServe's batch, then ONE dense call over those that
    # got that far (``batch_size`` > 1 at registration; one per arm in an experiment), then encode each; each request gets its
    # own status, a Server-Timing header with the core's stage times and its X-Request-Id (the
    # client's, else a new one; the impression's key when impressions are logged)
    def handle(self, data: list[dict], context) -> list[bytes]:
        from serving.scoring.impressions import HEADER, request_id
        from serving.scoring.loop import Outcome, Pending, complete_each, prepare, reply_of

        scorer, server_timing, router = self._pinned, self._server_timing, self.router
        if server_timing is None or (scorer is None and router is None):
            raise RuntimeError("handle called before initialize")
        rids = [request_id(_header(context, idx, HEADER)) for idx in range(len(data))]

        def start(idx: int, request: dict) -> Pending | Outcome:
            body, ctype = _body(request), _header(context, idx, "Content-Type")
            if router is not None:  # CURRENT's scorer, or the request's arm's (a 503 while none)
                return router.prepare(body, ctype, rids[idx])[1]
            assert scorer is not None
            return prepare(scorer, body, ctype, rids[idx], self.impressions)

        started = [start(idx, request) for idx, request in enumerate(data)]
        scored = iter(
            complete_each([p for p in started if isinstance(p, Pending)])
        )  # one dense run per scorer
        out = []
        for idx, p in enumerate(started):
            reply = reply_of(next(scored) if isinstance(p, Pending) else p)  # the boundary
            context.set_response_status(reply.status, "", idx)
            context.set_response_content_type(idx, "application/json")
            context.set_response_header(idx, "Server-Timing", server_timing(reply.timings))
            context.set_response_header(idx, HEADER, rids[idx])
            if self._metrics is not None:
                self._metrics.record(reply)
            out.append(reply.payload)
        return out


def _metrics(context, impressions: ImpressionLog | None) -> ScoringMetrics | None:
    """The scoring metrics (serving/torchserve/metrics.py), or None when this TorchServe was not
    started with their config (a stack not started by recserve): scoring does not depend on them."""
    from serving.torchserve.metrics import ScoringMetrics

    try:
        return ScoringMetrics(context, impressions=impressions)
    except Exception as e:  # noqa: BLE001 - MetricsCacheKeyError: not declared in this TorchServe
        import logging

        logging.getLogger("recserve.handler").warning("scoring metrics off: %s", e)
        return None


def _body(request: dict) -> bytes:
    body = request.get("body") or request.get("data") or b""
    return body.encode() if isinstance(body, str) else bytes(body)


def _header(context, idx: int, name: str) -> str | None:
    """A request header (``Content-Type``, ``X-Request-Id``) as TorchServe hands it over: in the
    part's own headers (a multipart body) or the request's, in any case."""
    for key in ("body", "data"):
        part = context.get_request_header(idx, key)
        if isinstance(part, dict) and part.get(name.lower()):
            return part[name.lower()]
    return context.get_request_header(idx, name) or context.get_request_header(idx, name.lower())
