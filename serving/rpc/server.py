"""One gRPC server bootstrap for every recserve service (the PS on grpc.aio, the worker on a
thread pool): message-size options, TLS (``Endpoint.tls``, ``serving.rpc.tls``), health and
reflection, Prometheus /metrics on its own port with the health as ``GET /ready`` beside it, SIGTERM/SIGINT, and a graceful stop (health
NOT_SERVING first, then in-flight calls get ``grace_s``).

A service is registered by ``add_service`` from its proto descriptor, not by the generated
``add_*Servicer_to_server``: those give gRPC the message's ``FromString`` as deserializer, and a
payload it cannot parse then fails inside gRPC, before any handler, as UNKNOWN (grpc.aio) or
INTERNAL (thread pool). Here every request reaches the ``rpc`` boundary as bytes and is parsed
there, after the access check, so an undecodable request is INVALID_ARGUMENT naming the method.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from serving.memory import freeze_loaded
from serving.rpc.metrics import Readiness
from serving.rpc.tls import ServerTLS

if TYPE_CHECKING:
    import grpc
    from grpc_health.v1 import health as grpc_health
    from prometheus_client import CollectorRegistry

log = logging.getLogger("recserve.rpc")

ServerT = TypeVar("ServerT", "grpc.Server", "grpc.aio.Server")
HealthT = TypeVar("HealthT", "grpc_health.HealthServicer", "grpc_health.aio.HealthServicer")


def grpc_options(max_message_mb: int) -> list[tuple[str, int]]:
    size = max_message_mb * 1024 * 1024
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]


@dataclass
class Endpoint:
    """Where and how a service listens (the common part of every server config)."""

    host: str
    port: int
    metrics_port: int
    max_message_mb: int
    grace_s: float
    tls: ServerTLS | None = None
    """TLS (and mTLS) settings; None: plaintext."""


@dataclass
class Running(Generic[ServerT, HealthT]):
    """A started server: the gRPC server, its health servicer, the bound port, a metrics stopper
    (thread-pool: ``SyncRunning``; grpc.aio: ``AioRunning``)."""

    server: ServerT
    health: HealthT
    port: int
    service: str
    stop_metrics: Callable[[], None]
    readiness: Readiness
    """The health as ``GET /ready`` on the metrics port tells it (``serving.rpc.metrics``)."""


SyncRunning = Running["grpc.Server", "grpc_health.HealthServicer"]
AioRunning = Running["grpc.aio.Server", "grpc_health.aio.HealthServicer"]


def add_service(server: grpc.Server | grpc.aio.Server, servicer: object, service: str) -> None:
    """Register every method of ``service`` (its full proto name, e.g. ``recserve.v1.EmbeddingPS``;
    its ``*_pb2`` module imported) on ``server``: ``servicer.<Method>`` gets the request as
    ``errors.Undecoded`` bytes, which its ``rpc`` boundary parses."""
    import functools

    import grpc
    from google.protobuf import descriptor_pool, message_factory

    from serving.rpc.errors import Undecoded

    handlers = {}
    for method in descriptor_pool.Default().FindServiceByName(service).methods:
        if method.client_streaming or method.server_streaming:
            raise TypeError(f"{service}.{method.name}: only unary RPCs are supported")
        request = message_factory.GetMessageClass(method.input_type)
        response = message_factory.GetMessageClass(method.output_type)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=functools.partial(Undecoded, request),
            response_serializer=response.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


def _bind(
    server: ServerT,
    endpoint: Endpoint,
    servicer: object,
    health: grpc_health.HealthServicer | grpc_health.aio.HealthServicer,
    service: str,
    registry: CollectorRegistry,
    readiness: Readiness,
) -> tuple[int, Callable[[], None]]:
    from grpc_health.v1 import health as health_mod
    from grpc_health.v1 import health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from serving.rpc.metrics import start_metrics_server

    add_service(server, servicer, service)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection((service, health_mod.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{endpoint.host}:{endpoint.port}"
    if endpoint.tls is None:
        port = server.add_insecure_port(address)
    else:
        port = server.add_secure_port(address, endpoint.tls.credentials())
        log.info("%s speaks %s", service, endpoint.tls.describe())
    if not port:
        raise OSError(f"cannot bind {address}")
    return port, start_metrics_server(endpoint.metrics_port, endpoint.host, registry, readiness)


def _status(serving: bool) -> int:
    from grpc_health.v1 import health_pb2

    return health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING


# ---- thread-pool servers (the worker) ----------------------------------------------------------
def start_sync(
    endpoint: Endpoint, service: str, servicer: object, registry: CollectorRegistry, threads: int
) -> SyncRunning:
    """Start a thread-pool gRPC server with health (NOT_SERVING until ``set_serving``)."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc
    from grpc_health.v1 import health

    server = grpc.server(
        ThreadPoolExecutor(threads, thread_name_prefix="rpc"), options=grpc_options(endpoint.max_message_mb)
    )
    health_servicer = health.HealthServicer()
    for name in ("", service):  # grpc's servicer starts with "" SERVING
        health_servicer.set(name, _status(False))
    readiness = Readiness()
    port, stop_metrics = _bind(server, endpoint, servicer, health_servicer, service, registry, readiness)
    server.start()
    return Running(server, health_servicer, port, service, stop_metrics, readiness)


def set_serving_sync(running: SyncRunning, serving: bool, why: str = "") -> None:
    """gRPC health SERVING or NOT_SERVING, and /ready with it (``why``: the reason it is not). The
    first SERVING takes what the process loaded out of the collector's scans (``freeze_loaded``)."""
    for name in ("", running.service):
        running.health.set(name, _status(serving))
    running.readiness.set(serving, why)
    if serving:
        freeze_loaded()


def wait_for_stop(stop: threading.Event | None = None) -> threading.Event:
    """Block until SIGTERM/SIGINT (main thread only) or ``stop`` is set."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    return stop


def stop_sync(running: SyncRunning, grace_s: float) -> None:
    log.info("shutting down (grace %.1fs)", grace_s)
    running.readiness.set(False, "shutting down")
    running.health.enter_graceful_shutdown()
    running.server.stop(grace_s).wait()
    running.stop_metrics()


# ---- asyncio servers (the PS) ------------------------------------------------------------------
async def start_aio(
    endpoint: Endpoint, service: str, servicer: object, registry: CollectorRegistry
) -> AioRunning:
    """Start a grpc.aio server with health (NOT_SERVING until ``set_serving_aio``)."""
    import grpc
    from grpc_health.v1 import health

    server = grpc.aio.server(options=grpc_options(endpoint.max_message_mb))
    health_servicer = health.aio.HealthServicer()
    for name in ("", service):  # grpc's servicer starts with "" SERVING
        await health_servicer.set(name, _status(False))
    readiness = Readiness()
    port, stop_metrics = _bind(server, endpoint, servicer, health_servicer, service, registry, readiness)
    await server.start()
    return Running(server, health_servicer, port, service, stop_metrics, readiness)


async def set_serving_aio(running: AioRunning, serving: bool, why: str = "") -> None:
    """gRPC health SERVING or NOT_SERVING, and /ready with it (``why``: the reason it is not). The
    first SERVING takes what the process loaded out of the collector's scans (``freeze_loaded``)."""
    for name in ("", running.service):
        await running.health.set(name, _status(serving))
    running.readiness.set(serving, why)
    if serving:
        freeze_loaded()


def stop_event_on_signals() -> asyncio.Event:
    """An event set by SIGTERM/SIGINT (when this loop may install signal handlers)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass
    return stop


async def stop_aio(running: AioRunning, grace_s: float) -> None:
    log.info("shutting down (grace %.1fs)", grace_s)
    running.readiness.set(False, "shutting down")
    await running.health.enter_graceful_shutdown()
    await running.server.stop(grace_s)
    running.stop_metrics()
