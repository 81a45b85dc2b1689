"""Prometheus ``/metrics`` on its own HTTP port, one registry per process role.

Each service builds its own ``CollectorRegistry`` (so tests can run several in one process) and
calls ``start_metrics_server``; port 0 means metrics are off.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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


def start_metrics_server(port: int, host: str, registry: CollectorRegistry) -> Callable[[], None]:
    """Serve ``registry`` at http://host:port/metrics in a daemon thread; returns a stop function
    (a no-op when ``port`` is 0)."""
    if not port:
        return lambda: None
    from prometheus_client import start_http_server

    httpd, thread = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, port)

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
