"""Errors at the gRPC boundary, handled once: one exception -> status table and one decorator
that every RPC of every recserve service wears (sync or grpc.aio).

Client mistakes are INVALID_ARGUMENT wherever they are found: ``ValueError`` covers ``BadRequest``,
``CodecError``, ``BatchError`` and the cores' own argument checks. A domain error that knows its
class of failure says so with a ``grpc_status`` attribute naming a ``grpc.StatusCode`` (a shard that
could not be reached is UNAVAILABLE); nothing is classified by matching message strings.

A component that runs but serves no model version (``NotServing``, or any error with a true
``not_serving`` attribute) answers UNAVAILABLE with a marker in the trailing metadata, so each hop
(PS -> worker -> scoring) passes its message on unchanged: the HTTP 503 says which shard serves no
version and why, not "worker unavailable".

Every RPC passes its server's ``Access`` (``self.access``, ``serving.rpc.auth``) before it runs, and
requests arrive as bytes (``Undecoded``, see ``serving.rpc.server.add_service``) that are parsed
here, after the access check: a payload that is not the method's message is INVALID_ARGUMENT,
never the UNKNOWN or INTERNAL that gRPC answers when its own deserializer fails.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from model_store.errors import StoreError

if TYPE_CHECKING:
    import grpc
    from google.protobuf.message import Message

    Context = grpc.ServicerContext | grpc.aio.ServicerContext[Any, Any]
    """A call's server-side context, thread-pool or grpc.aio."""
    Metadata = Iterable[tuple[str, str | bytes]]
    """A call's metadata: (key, value) pairs."""

log = logging.getLogger("recserve.rpc")

_Method = TypeVar("_Method", bound=Callable[..., Any])


NOT_SERVING_KEY = "recserve-not-serving"
"""Trailing-metadata key of an UNAVAILABLE answered because no model version is served."""


class BadRequest(ValueError):
    """The request is malformed; maps to INVALID_ARGUMENT."""


class NotServing(RuntimeError):
    """Up, but serving no model version (none published yet, or the one named was refused); the
    message names the component and why. Maps to UNAVAILABLE, marked with ``NOT_SERVING_KEY``."""

    grpc_status = "UNAVAILABLE"
    not_serving = True


class Unauthenticated(Exception):
    """The call carries no credentials and needs them; maps to UNAUTHENTICATED."""

    grpc_status = "UNAUTHENTICATED"


class PermissionDenied(Exception):
    """The caller may not do this (wrong token, an RPC this server does not serve, a path outside
    its root); maps to PERMISSION_DENIED."""

    grpc_status = "PERMISSION_DENIED"


class Undecoded:
    """A request as it came off the wire, parsed by the ``rpc`` boundary (``parse``)."""

    __slots__ = ("data", "message")

    def __init__(self, message: type[Message], data: bytes):
        self.message = message
        self.data = data

    def parse(self, method: str) -> Message:
        from google.protobuf.message import DecodeError

        try:
            return self.message.FromString(self.data)
        except DecodeError as e:
            name = self.message.DESCRIPTOR.full_name
            raise BadRequest(
                f"{method}: the request ({len(self.data)} bytes) is not a valid {name}: {e}"
            ) from None


def not_serving(rpc_error: grpc.RpcError) -> bool:
    """Whether a ``grpc.RpcError`` is an UNAVAILABLE marked as "serves no version" by the peer."""
    trailing = getattr(rpc_error, "trailing_metadata", None)
    metadata = (trailing() if callable(trailing) else None) or ()
    return any(key == NOT_SERVING_KEY for key, _ in metadata)


def _metadata(e: BaseException) -> tuple[tuple[str, str], ...]:
    return ((NOT_SERVING_KEY, "1"),) if getattr(e, "not_serving", False) else ()


def status_of(e: BaseException, method: str = "call") -> tuple[grpc.StatusCode, str]:
    """``(grpc.StatusCode, message)`` for an exception an RPC raised."""
    import grpc

    named = getattr(e, "grpc_status", None)
    if named:
        return grpc.StatusCode[named], str(e)
    if isinstance(e, StoreError):  # a dump or delta that cannot be used: the request was fine
        return grpc.StatusCode.FAILED_PRECONDITION, str(e)
    if isinstance(e, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, KeyError):
        return grpc.StatusCode.NOT_FOUND, str(e.args[0]) if e.args else "not found"
    if isinstance(e, OSError):
        return grpc.StatusCode.UNAVAILABLE, f"I/O error: {e}"
    log.error("%s failed", method, exc_info=e)
    return grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(e).__name__}: {e}"


def _deadline_passed(context: Context) -> bool:
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


def _admit(servicer: object, name: str, request: Message | Undecoded, context: Context) -> Message:
    """The checks before a method runs: its server's ``Access``, then the request parsed."""
    access = getattr(servicer, "access", None)
    if access is not None:
        access.check(name, context)
    return request.parse(name) if isinstance(request, Undecoded) else request


def _count(servicer: object, code: grpc.StatusCode) -> None:
    metrics = getattr(servicer, "metrics", None)
    errors = getattr(metrics, "errors", None)
    if errors is not None:
        errors.labels(code.name).inc()


def rpc(method: _Method) -> _Method:
    """The error boundary of an RPC method: a call whose deadline already passed is not started;
    the server's access policy and the request's parsing come next (``_admit``); exceptions become
    the status of ``status_of`` (counted in ``self.metrics.errors`` by code)."""
    import grpc

    name = method.__name__
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def async_wrapper(
            self: object, request: Message | Undecoded, context: grpc.aio.ServicerContext[Any, Any]
        ) -> Message:
            if _deadline_passed(context):
                _count(self, grpc.StatusCode.DEADLINE_EXCEEDED)
                await context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the call started"
                )
            try:
                response: Message = await method(self, _admit(self, name, request, context), context)
                return response
            except Exception as e:
                if type(e).__name__ == "AbortError":  # context.abort() inside the method
                    raise
                code, message = status_of(e, name)
                _count(self, code)
                await context.abort(code, message, _metadata(e))

        return cast(_Method, async_wrapper)  # the same method to gRPC, with the boundary around it

    @functools.wraps(method)
    def wrapper(self: object, request: Message | Undecoded, context: grpc.ServicerContext) -> Message:
        if _deadline_passed(context):
            _count(self, grpc.StatusCode.DEADLINE_EXCEEDED)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the call started")
        try:
            response: Message = method(self, _admit(self, name, request, context), context)
            return response
        except Exception as e:
            code, message = status_of(e, name)
            _count(self, code)
            if metadata := _metadata(e):
                context.set_trailing_metadata(metadata)
            context.abort(code, message)

    return cast(_Method, wrapper)
