"""TorchServe handler for recserve scoring: an adapter over ``serving.scoring.core.Scorer``.

TorchServe calls ``initialize(context)`` once per worker process and ``handle(data, context)``
per batch of requests (batching on): TorchServe's batch runs through the scoring core's request
loop (``serving.scoring.loop``: each request decoded and looked up, then ONE dense run), and this
is its frontend's boundary, where each request's Outcome becomes its status by the one errors
table (``serving.scoring.loop.reply_of``). Everything else -- decoding, features, the embedding
worker, the dense model -- lives in the scoring core. No import-time side effects: the core is
imported in ``initialize``.

The archive carries ``scoring.json`` (a ``ScoringConfig``: which model-store version to serve,
the worker address, the runtime and device (``"device": "cuda"``: the dense model on a GPU),
limits). TorchServe must run with TS_DECODE_INPUT_REQUEST=false
so request bodies arrive as bytes and are read once, in the core (serving.scoring.decoding).
"""

from __future__ import annotations

import atexit
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.scoring.core import Scorer
    from serving.scoring.impressions import ImpressionLog
    from serving.torchserve.metrics import ScoringMetrics


class RecserveHandler:
    def __init__(self) -> None:
        self.scorer: Scorer | None = None
        self._metrics: ScoringMetrics | None = None
        self._server_timing: Callable[[dict], str] | None = None
        self.impressions: ImpressionLog | None = None
        self.initialized = False

    def initialize(self, context) -> None:
        from serving.priority import loading_priority, share_gil_with_followers
        from serving.scoring.config import ScoringConfig
        from serving.scoring.core import Scorer, server_timing

        self._server_timing = server_timing
        model_dir = Path(context.system_properties["model_dir"])
        config = ScoringConfig.from_dict(json.loads((model_dir / "scoring.json").read_text()))
        with loading_priority():  # a version loading beside a serving one yields the CPU to it
            self.scorer = Scorer(config)
        if "colocated" in self.scorer.lookup_modes:  # its co-located shards' followers share the GIL
            share_gil_with_followers()
        if config.log_impressions:
            from serving.scoring.impressions import ImpressionLog

            self.impressions = ImpressionLog(config.log_impressions)
            atexit.register(self.impressions.close)  # TorchServe never calls close: deliver what is queued
        self._metrics = _metrics(context, self.scorer, self.impressions)
        self.initialized = True

    # decode and look up each request of TorchServe's batch, then ONE dense call over those that
    # got that far (``batch_size`` > 1 at registration), then encode each; each request gets its
    # own status, a Server-Timing header with the core's stage times and its X-Request-Id (the
    # client's, else a new one; the impression's key when impressions are logged)
    def handle(self, data: list[dict], context) -> list[bytes]:
        from serving.scoring.impressions import HEADER, request_id
        from serving.scoring.loop import Pending, complete, prepare, reply_of

        scorer, server_timing = self.scorer, self._server_timing
        if scorer is None or server_timing is None:
            raise RuntimeError("handle called before initialize")
        rids = [request_id(_header(context, idx, HEADER)) for idx in range(len(data))]
        started = [prepare(scorer, _body(request), _header(context, idx, "Content-Type"), rids[idx], self.impressions)
                   for idx, request in enumerate(data)]  # fmt: skip
        scored = iter(complete([p for p in started if isinstance(p, Pending)]))
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


def _metrics(context, scorer: Scorer, impressions: ImpressionLog | None) -> ScoringMetrics | None:
    """The scoring metrics (serving/torchserve/metrics.py), or None when this TorchServe was not
    started with their config (a stack not started by recserve): scoring does not depend on them."""
    from serving.torchserve.metrics import ScoringMetrics

    try:
        return ScoringMetrics(
            context,
            scorer.dense_version,
            scorer.lookup_modes,
            scorer.runtime,
            impressions=impressions,
            device=scorer.choice.device,
        )
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
