"""The ``EmbeddingWorker`` gRPC service (``recserve worker``): a thin servicer over ``core``.

Its gRPC health is SERVING exactly while every PS shard it routes to is (``health.mirror``): a
shard that serves no version makes the worker NOT_SERVING, and a Forward that needs it fails with
UNAVAILABLE naming the shard and why, never with default rows.

A synchronous gRPC server with a thread pool: the core is blocking (its shard fan-out uses threads
and the gRPC client releases the GIL), so a handler thread calls it directly; under grpc.aio every
Forward would need a hop to a thread for the same work. Measured on loopback: an empty RPC costs
~0.4 ms here against ~0.6-0.8 ms for the grpc.aio PS's Stats.

``Forward`` and ``Stats`` are open (``worker_access``): the worker only reads, never inserting
rows, so it holds no admin token and no caller can write through it. A trainer looks its rows up
and pools itself (``training.ctx``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from serving.rpc import convert
from serving.rpc.auth import Access
from serving.rpc.config import ServerConfig
from serving.rpc.errors import BadRequest, rpc

log = logging.getLogger("recserve.worker")

SERVICE = "recserve.v1.EmbeddingWorker"


def _worker_server() -> ServerConfig:
    return ServerConfig(port=50071, max_message_mb=256)


@dataclass
class WorkerServerConfig:
    """One embedding-worker process."""

    ps: tuple[str, ...] = ()
    """PS shard addresses HOST:PORT, shard i at position i; a shard's replicas separated by '|'
    (a:1|a:2,b:1|b:2: lookups spread over a shard's SERVING replicas, failing over between them)."""
    schema: str = "data/schemas/criteo.yaml"
    """Feature schema the compact batches must be built for."""
    threads: int = 8
    """gRPC handler threads (concurrent calls)."""
    ps_timeout_s: float = 5.0
    """Deadline of each PS call; also how long startup waits for each shard."""
    health_poll_s: float = 0.5
    """How often the shards' health is checked: the worker is SERVING while every shard is (a
    replicated shard while one of its replicas is)."""
    ps_tls_ca: str = ""
    """TLS to the PS shards: the CA that signed their certificates (PEM). Without any --ps-tls-*
    flag the worker speaks plaintext to them."""
    ps_tls_cert: str = ""
    """mTLS to the PS shards: this worker's client certificate (PEM; with --ps-tls-key)."""
    ps_tls_key: str = ""
    """mTLS to the PS shards: the client certificate's private key (PEM, mode 0600)."""
    server: ServerConfig = field(default_factory=_worker_server)
    """Where the worker listens (host, port, metrics port, TLS, ...)."""

    def __post_init__(self) -> None:
        self.ps_tls()  # a missing file, or a key that is not the certificate's: say so now
        if self.ps:
            from serving.worker.replicas import parse_ps_spec

            parse_ps_spec(self.ps)  # a malformed spec is a configuration error, said at once

    def ps_tls(self):
        from serving.rpc.tls import ClientTLS

        return ClientTLS.of(self.ps_tls_ca, self.ps_tls_cert, self.ps_tls_key)


class _Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        from serving.rpc.metrics import LATENCY_BUCKETS, rpc_errors

        self.registry = CollectorRegistry()
        self.forward_seconds = Histogram(
            "recserve_worker_forward_seconds",
            "Forward time in the server (decode, lookup, pool, encode)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batches = Counter("recserve_worker_batches", "Forward batches", registry=self.registry)
        self.rows = Counter("recserve_worker_rows", "Rows pooled", registry=self.registry)
        self.errors = rpc_errors("recserve_worker_errors", self.registry)


def worker_access() -> Access:
    """Forward and Stats for anyone: the worker only reads (it writes nothing to the shards)."""
    return Access("embedding worker", open=frozenset({"Forward", "Stats"}))


class EmbeddingWorkerServicer:
    """gRPC adapter of one ``EmbeddingWorker``; ``access`` is its ``worker_access`` policy."""

    def __init__(self, worker, access: Access, metrics: _Metrics):
        from recserve.v1 import common_pb2, worker_pb2

        self.worker = worker
        self.access = access
        self.metrics = metrics
        self.pb = worker_pb2
        self.common = common_pb2

    @rpc
    def Forward(self, request, context):
        from features.codec import decode

        t0 = time.perf_counter()
        if not request.batch:
            raise BadRequest("empty request: no compact batch")
        fp16 = convert.wants_fp16(request.dtype)
        batch = decode(request.batch, schema_hash=self.worker.schema.hash64)
        res = self.worker.forward(batch, version=request.version, timeout_s=context.time_remaining())
        pooled = res.pooled.astype(np.float16) if fp16 else res.pooled
        reply = self.pb.ForwardResponse(
            pooled=pooled.tobytes(),
            num_rows=pooled.shape[0],
            num_slots=pooled.shape[1],
            dim=pooled.shape[2],
            dtype=self.common.FLOAT16 if fp16 else self.common.FLOAT32,
            version=self.common.ModelVersion(version=res.version[0], delta_seq=res.version[1]),
            shards=[self.common.ModelVersion(version=v, delta_seq=q) for v, q in res.shards],
        )
        self.metrics.forward_seconds.observe(time.perf_counter() - t0)
        self.metrics.batches.inc()
        self.metrics.rows.inc(batch.num_rows)
        return reply

    @rpc
    def Stats(self, request, context):
        w = self.worker
        version, seq = w.version()
        return self.pb.WorkerStatsResponse(
            num_shards=len(w.shards),
            dim=w.dim,
            schema=w.schema.name,
            schema_hash=f"{w.schema.hash64:016x}",
            version=self.common.ModelVersion(version=version, delta_seq=seq),
        )


def serve(
    config: WorkerServerConfig,
    stop: threading.Event | None = None,
    started: Callable[[int], None] | None = None,
) -> int:
    """Run the worker until SIGTERM/SIGINT (or ``stop`` is set); returns the exit code.
    ``started(port)`` is called once it serves."""
    from features.schema import load_schema
    from recserve.v1 import worker_pb2  # noqa: F401  (registers the service add_service looks up)
    from serving.rpc import health
    from serving.rpc import server as rpc_server
    from serving.worker.core import ShardError, connect
    from serving.worker.shards import RemoteShard

    if not config.ps:
        log.error("no PS shards given (--ps HOST:PORT,...)")
        return 2
    try:
        schema = load_schema(config.schema)
        worker = connect(
            list(config.ps), schema, timeout_s=config.ps_timeout_s, tls=config.ps_tls(),
            health_poll_s=config.health_poll_s,
        )  # fmt: skip
    except (ShardError, ValueError, OSError) as e:
        log.error("cannot start: %s", e)
        return 1
    metrics = _Metrics()
    servicer = EmbeddingWorkerServicer(worker, worker_access(), metrics)
    try:
        running = rpc_server.start_sync(
            config.server.endpoint(), SERVICE, servicer, metrics.registry, config.threads
        )
    except OSError:
        worker.close()
        raise
    # SERVING exactly while every shard is (a shard without its version is NOT_SERVING; a
    # replicated one is SERVING while one of its replicas is)
    remote = cast("list[RemoteShard]", worker.shards)  # connect() gives PSClients and ReplicaSets
    shards = {f"shard {i} ({s.target})": s.health for i, s in enumerate(remote)}
    mirror = health.mirror(
        shards, lambda ok, why: rpc_server.set_serving_sync(running, ok, why), config.health_poll_s
    )
    log.info(
        "worker for %s listening on %s:%d over %d PS shards (dim %d)",
        schema.name, config.server.host, running.port, len(config.ps), worker.dim,
    )  # fmt: skip
    if started is not None:
        started(running.port)
    rpc_server.wait_for_stop(stop)
    mirror.set()
    rpc_server.stop_sync(running, config.server.grace_s)
    worker.close()
    return 0
