"""The lean frontend's HTTP face (``recserve serve``): an ASGI application whose routes are small
named functions, over a ``Frontend``: what the app needs of one (``serving.scoring.lean.Frontend``
is the one there is).

``GET /ping``, ``GET /metrics`` and ``POST /predictions/<model>`` (token auth first; its
``X-Request-Id``, the client's or a new one, answered in a header and logged with the impression
by the request loop when the frontend logs them); a route
raises what refuses a request (``serving.scoring.errors``: 404, 405, 401, 413) and the one
boundary, ``App.__call__``, maps it by the errors table; a scored request's Outcome is mapped by
the same table (``reply_of``) and counted by the frontend. Scoring runs the request loop
(``serving.scoring.loop``) through the frontend's router (``serving.scoring.arms.Router``: CURRENT's
scorer, or the request's arm's while an experiment runs): alone, or with its dense stage
micro-batched (``DenseBatcher``, which runs each scorer's requests apart); a scorer with a remote
shard runs its blocking RPCs off the event loop. Every response names the process that answered
(``X-Recserve-Pid``).

A worker of a frontend of several processes (``FrontendProcess``: ``recserve serve --workers N``)
answers ``/metrics`` for the whole frontend, and finishes its first look at the store (the version
loaded, or why not known) before it starts taking connections: a connection to the port goes to a
worker that can answer it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import orjson

from serving.scoring.batching import DenseBatcher
from serving.scoring.core import Scorer, server_timing
from serving.scoring.errors import (
    MethodNotAllowed,
    NotFound,
    Reply,
    TooLarge,
    Unauthorized,
    error_body,
    status_of,
)
from serving.scoring.impressions import request_id
from serving.scoring.loop import Outcome, Pending, reply_of

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Histogram

    from serving.scoring.arms import Router
    from serving.scoring.config import ScoringConfig
    from serving.scoring.impressions import ImpressionLog

PREDICTIONS = "/predictions/"

log = logging.getLogger("recserve.serve")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
T = TypeVar("T")


class FrontendConfig(Protocol):
    """The frontend's settings the app reads (``serving.scoring.lean.ServeConfig``)."""

    model: str
    disable_token_auth: bool
    batch_wait_ms: float
    batch_max_items: int
    scoring: ScoringConfig


class Frontend(Protocol):
    """What the app needs of a frontend: the served scorer (None until a version loads), its
    token, metrics and impression log, and the verbs of its life (follow the store, close)."""

    @property
    def config(self) -> FrontendConfig: ...
    @property
    def scorer(self) -> Scorer | None: ...
    @property
    def token(self) -> str: ...
    @property
    def registry(self) -> CollectorRegistry: ...
    @property
    def batched(self) -> Histogram: ...
    @property
    def impressions(self) -> ImpressionLog | None: ...
    @property
    def router(self) -> Router: ...

    def not_serving_reason(self) -> str: ...
    def step(self) -> str | None: ...
    def record(self, scorer: Scorer, reply: Reply) -> Reply: ...
    async def follow(self) -> None: ...
    def close(self) -> None: ...


class FrontendProcess(NamedTuple):
    """This process as one worker of a frontend of several (``serving.scoring.processes``)."""

    metrics: CollectorRegistry
    """What ``/metrics`` answers: the whole frontend's (``serving.scoring.multiproc``)."""
    ready: Callable[[], None]
    """Told once the first look at the store is done, as the worker starts taking connections."""


class Response(NamedTuple):
    status: int
    body: bytes
    content_type: bytes = b"application/json"
    headers: tuple[tuple[bytes, bytes], ...] = ()

    async def send(self, send: Send, *extra: tuple[bytes, bytes]) -> None:
        headers = [(b"content-type", self.content_type), (b"content-length", str(len(self.body)).encode()),
                   *self.headers, *extra]  # fmt: skip
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": self.body})


def refused(e: Exception) -> Response:
    """The answer to a request a route refused: its status and message by the errors table."""
    status, message = status_of(e)
    return Response(status, error_body(message), headers=getattr(e, "headers", ()))


def answered(reply: Reply, rid: str) -> Response:
    """The answer to a scoring request, with its stage times as a Server-Timing header and its
    request id."""
    return Response(reply.status, reply.payload, headers=(
        (b"server-timing", server_timing(reply.timings).encode()), (b"x-request-id", rid.encode("latin-1"))))  # fmt: skip


class App:
    """The ASGI application over ``frontend`` (``process``: a worker of several's; None: alone)."""

    def __init__(self, frontend: Frontend, process: FrontendProcess | None = None):
        config = frontend.config
        self.frontend, self.process = frontend, process
        self.exposed = frontend.registry if process is None else process.metrics
        self.pid = (b"x-recserve-pid", str(os.getpid()).encode())
        self.model_path = PREDICTIONS + config.model
        self.max_body = config.scoring.max_body_bytes
        self.expected_auth = None if config.disable_token_auth else b"Bearer " + frontend.token.encode()
        wait_s = config.batch_wait_ms / 1e3
        self.batcher = (
            DenseBatcher(wait_s, config.batch_max_items, frontend.batched.observe) if wait_s > 0 else None
        )
        self._follower: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await self.lifespan(receive, send)
        if scope["type"] != "http":
            return
        try:
            response = await self.route(scope, receive)
        except Exception as e:  # the boundary: every refusal mapped here, by the one table
            response = refused(e)
        await response.send(send, self.pid)

    async def route(self, scope: Scope, receive: Receive) -> Response:
        path, method = scope["path"], scope["method"]
        if path == "/ping" and method == "GET":
            return self.ping()
        if path == "/metrics" and method == "GET":
            return self.metrics()
        self.check_target(path, method)
        self.check_token(scope)
        return await self.predictions(scope, receive)

    # ---- routes ---------------------------------------------------------------------------------
    def ping(self) -> Response:
        scorer = self.frontend.scorer
        if scorer is None:
            return Response(
                503, orjson.dumps({"status": "Unhealthy", "error": self.frontend.not_serving_reason()})
            )
        return Response(200, orjson.dumps({"status": "Healthy", "version": scorer.dense_version,
                                           "lookups": scorer.lookup_modes}))  # fmt: skip

    def metrics(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(200, generate_latest(self.exposed), CONTENT_TYPE_LATEST.encode())

    async def predictions(self, scope: Scope, receive: Receive) -> Response:
        headers = dict(scope["headers"])
        ctype = headers.get(b"content-type", b"").decode("latin-1") or None
        rid = request_id(headers.get(b"x-request-id"))
        if self.batcher is None:
            body = await self.read_body(receive)
            scorer, outcome = await self.hop(self.frontend.router.run, body, ctype, rid)
        else:
            scorer, outcome = await self.micro_batched(self.batcher, receive, ctype, rid)
        reply = reply_of(outcome)  # what the scoring failed on, mapped by the same table
        return answered(reply if scorer is None else self.frontend.record(scorer, reply), rid)

    # ---- its steps ------------------------------------------------------------------------------
    def check_target(self, path: str, method: str) -> None:
        if not path.startswith(PREDICTIONS):
            raise NotFound(f"no such path {path}: POST {self.model_path}")
        if path.rstrip("/") != self.model_path:
            raise NotFound(f"model {path[len(PREDICTIONS) :]!r} is not served here: POST {self.model_path}")
        if method != "POST":
            raise MethodNotAllowed(f"{method} {path}: use POST", headers=((b"allow", b"POST"),))

    def check_token(self, scope: Scope) -> None:
        if self.expected_auth is None:
            return
        sent = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(sent, self.expected_auth):
            raise Unauthorized("token authorization failed: send the inference key of the key file as "
                               "'Authorization: Bearer <key>'")  # fmt: skip

    async def read_body(self, receive: Receive) -> bytes:
        chunks, size = [], 0
        while True:
            msg = await receive()
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise TooLarge(f"request body exceeds the limit of {self.max_body} bytes")
            chunks.append(chunk)
            if not msg.get("more_body"):
                return b"".join(chunks)

    async def micro_batched(
        self, batcher: DenseBatcher, receive: Receive, ctype: str | None, rid: str
    ) -> tuple[Scorer | None, Outcome]:
        """A request in progress from its first byte (``DenseBatcher.begin``) until it joins a run
        or leaves without one."""
        batcher.begin()
        joined = False
        try:
            body = await self.read_body(receive)
            scorer, pending = await self.hop(self.frontend.router.prepare, body, ctype, rid)
            if not isinstance(pending, Pending):
                return scorer, pending
            joined = True
            return scorer, await batcher.dense(pending)
        finally:
            if not joined:
                batcher.end()

    async def hop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` off the event loop when the served scorer makes blocking RPCs (a remote
        shard; an experiment's arms are read as it is); in-process work runs on it (a thread hop
        would cost more than it frees)."""
        scorer = self.frontend.scorer
        if scorer is not None and "remote" in scorer.lookup_modes:
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        return fn(*args)

    async def lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                if self.process is not None:  # a worker takes connections once it can answer them
                    await self.first_look(self.process)
                self._follower = asyncio.create_task(self.frontend.follow())
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                if self._follower is not None:
                    self._follower.cancel()
                await asyncio.get_running_loop().run_in_executor(None, self.frontend.close)
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def first_look(self, process: FrontendProcess) -> None:
        """One step of the follower (the version CURRENT names loaded, or why not known), then
        ``process.ready``; ``follow`` steps on from there."""
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.frontend.step)
        except Exception:  # as ``follow``: serve what there is, say why, and look again at the poll
            log.exception("follow step failed")
        process.ready()
