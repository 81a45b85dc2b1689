"""Prometheus ``/metrics`` on its own HTTP port, one registry per process role, and a gRPC
server's readiness as ``GET /ready`` on the same port.

Each service builds its own ``CollectorRegistry`` (so tests can run several in one process) and
calls ``start_metrics_server``; port 0 means metrics (and /ready) are off.

``/ready`` answers 200 ``SERVING`` exactly while the server's gRPC health says SERVING, and 503
``NOT_SERVING: <why>`` otherwise. It is there for probes that cannot speak the server's gRPC:
Kubernetes' gRPC probe has no TLS, so a PS or worker serving TLS is probed over HTTP here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable
    from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

    from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)

# Latency buckets from 50 us to 2.5 s: PS and worker calls live in the sub-millisecond range.
LATENCY_BUCKETS = (
    5e-5,
    1e-4,
    2e-4,
    3e-4,
    5e-4,
    7.5e-4,
    1e-3,
    2e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    1.0,
    2.5,
)


class Readiness:
    """A server's readiness as ``/ready`` tells it: not ready until ``set`` says so, with why."""

    def __init__(self, why: str = "starting") -> None:
        self.ready, self.why = False, why

    def set(self, ready: bool, why: str = "") -> None:
        self.ready, self.why = ready, "" if ready else why or "not serving"

    def app(self, metrics_app: WSGIApplication) -> WSGIApplication:
        """A WSGI app answering ``/ready`` itself and everything else with ``metrics_app``."""

        def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
            if environ.get("PATH_INFO") != "/ready":
                return metrics_app(environ, start_response)
            ready, why = self.ready, self.why  # one reading: set() may run meanwhile
            body = b"SERVING\n" if ready else f"NOT_SERVING: {why}\n".encode()
            status = "200 OK" if ready else "503 Service Unavailable"
            start_response(
                status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
            )
            return [body]

        return app


class MetricsPortError(OSError):
    """The /metrics port cannot be listened on (taken, or not this host's address): a process
    refuses to start, saying which address and flag, instead of dying with a traceback."""


def start_metrics_server(
    port: int, host: str, registry: CollectorRegistry, readiness: Readiness | None = None
) -> Callable[[], None]:
    """Serve ``registry`` at http://host:port/metrics (and ``readiness`` at /ready) in a daemon
    thread; returns a stop function (a no-op when ``port`` is 0). ``MetricsPortError`` when the
    address cannot be listened on."""
    if not port:
        return lambda: None
    from prometheus_client import start_http_server

    try:
        httpd, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise MetricsPortError(
            f"cannot serve /metrics on {host}:{port} (--metrics-port): {e.strerror or e}"
        ) from None
    if readiness is not None:
        metrics_app = httpd.get_app()
        assert metrics_app is not None  # start_http_server gave it one
        httpd.set_app(readiness.app(metrics_app))
    log.info("metrics on http://%s:%d/metrics%s", host, port, " (and /ready)" if readiness else "")

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)

    return stop


def version_refusals(registry: CollectorRegistry, component: str = "") -> Counter:
    """``recserve_version_refusals_total{component, kind}``: versions (kind="version") and deltas
    (kind="delta") a serving component (component="ps", "controller") refused -- the gate
    (``model_store.validate``) or its store said no -- so an alert can fire where a log line
    would go unread. Callers do ``.labels(component, kind).inc()``."""
    from prometheus_client import Counter

    counter = Counter(
        "recserve_version_refusals",
        "Versions and deltas a serving component refused (it keeps serving what it has)",
        ["component", "kind"],
        registry=registry,
    )
    if component:  # its series exist (at 0) from the start
        for kind in ("version", "delta"):
            counter.labels(component, kind)
    return counter


# Status codes an RPC of ours answers with besides OK: their counters exist (at 0) from the start,
# so a dashboard's rate() has a series before the first error.
ERROR_CODES = ("INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "RESOURCE_EXHAUSTED", "UNAVAILABLE",
               "DEADLINE_EXCEEDED", "UNAUTHENTICATED", "PERMISSION_DENIED", "INTERNAL")  # fmt: skip


def rpc_errors(name: str, registry: CollectorRegistry) -> Counter:
    """``<name>{code}``: RPCs a server answered with an error, by status code (one series per
    code from the start). The ``rpc`` decorator counts into it (``servicer.metrics.errors``)."""
    from prometheus_client import Counter

    counter = Counter(name, "RPCs answered with an error", ["code"], registry=registry)
    for code in ERROR_CODES:
        counter.labels(code)
    return counter
