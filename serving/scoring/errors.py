"""The scoring endpoint's errors, mapped once: ONE table from exception type to HTTP status and
message (``STATUSES``), read by each frontend at its boundary (the request loop's ``reply_of`` for
a scored request, ``status_of`` for anything a route refuses) and nowhere else.

The verbs raise what they find (a ``CodecError``, orjson's ``JSONDecodeError``, a ``FeatureError``,
a ``LookupFailed`` wrapping the embedding worker's exception, or one of the ``HTTPError`` below);
nothing on the way out translates them. A client's mistake is a 400/413/415 naming the problem,
an embedding shard serving no version or an unreachable worker a 503 naming which and why, and
anything else a 500 naming the exception (a bug, not the client's fault: serving goes on).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import orjson

from features.batch import BatchError
from features.codec import CodecError
from features.inputs import FeatureError


class HTTPError(Exception):
    """A request refused with ``status`` (the class's), its message naming why, and the headers
    that go with the status (405: Allow)."""

    status = 500

    def __init__(self, message: str, headers: tuple[tuple[bytes, bytes], ...] = ()):
        super().__init__(message)
        self.message = message
        self.headers = headers


class BadRequest(HTTPError):
    status = 400


class Unauthorized(HTTPError):
    status = 401


class NotFound(HTTPError):
    status = 404


class MethodNotAllowed(HTTPError):
    status = 405


class TooLarge(HTTPError):
    status = 413


class UnsupportedType(HTTPError):
    status = 415


class Unavailable(HTTPError):
    """Nothing can score it now (no version served yet): the message says why."""

    status = 503


class LookupFailed(Exception):
    """The embedding lookup of a request failed; ``cause`` is the worker's (or a shard's)
    exception, whose class decides the status (``forward_status``)."""

    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause


class Reply(NamedTuple):
    """What a frontend answers for one scoring request."""

    status: int  # HTTP status
    payload: bytes  # JSON body
    timings: dict[str, float]  # stage -> ms (decode, worker, dense, encode when scored; total always)
    versions: dict[str, Any]  # what answered (embedding, delta_seq, dense, shards; an experiment's arm,
    # experiment); empty unless scored, but for a failed request's arm


def forward_status(e: Exception) -> tuple[int, str]:
    """(HTTP status, message) for a failed worker Forward (a ``WorkerClient``'s or an in-process
    worker's exception), classified by ``serving.rpc.errors.status_of`` like every gRPC error:
    the client's mistake is a 400 with the worker's own message; a shard serving no version a 503
    naming it and why; an unreachable or late worker or shard a 503; anything else a 500."""
    import grpc

    from serving.rpc.errors import status_of as grpc_status_of

    if getattr(e, "not_serving", False):  # a shard without its version: which, and why
        return 503, str(e)
    code, _ = grpc_status_of(e, "Forward")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        details = getattr(e.__cause__, "details", None)  # the worker's words, not the client's wrapping
        return 400, str(details() if callable(details) else e)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return 503, f"embedding worker unavailable: {_short(e)}"
    return 500, f"embedding worker failed: {_short(e)}"


def _http(e: Any) -> tuple[int, str]:
    return int(e.status), str(e.message)


STATUSES: tuple[tuple[type[Exception], Callable[[Any], tuple[int, str]]], ...] = (
    (HTTPError, _http),
    (LookupFailed, lambda e: forward_status(e.cause)),
    (CodecError, lambda e: (400, f"invalid compact batch: {e}")),
    (BatchError, lambda e: (400, f"invalid compact batch: {e}")),
    (orjson.JSONDecodeError, lambda e: (400, f"malformed JSON: {e}")),
    (FeatureError, lambda e: (400, str(e))),
    (Exception, lambda e: (500, f"internal error: {_short(e)}")),
)
"""Exception type -> (HTTP status, message), the first row the exception is an instance of."""


def status_of(e: Exception) -> tuple[int, str]:
    """(HTTP status, message) of ``e``, by ``STATUSES``."""
    for kind, rule in STATUSES:
        if isinstance(e, kind):
            return rule(e)
    raise AssertionError("STATUSES ends with Exception")  # pragma: no cover


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


def _short(e: Exception) -> str:
    text = getattr(e, "details", None)
    text = text() if callable(text) else str(e)
    return f"{type(e).__name__}: {text}"[:300]
