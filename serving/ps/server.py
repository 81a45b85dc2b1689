"""The ``EmbeddingPS`` gRPC service: one process per shard (``recserve ps``).

The servicer is thin: it checks and converts protobuf payloads, calls the ``EmbeddingStore`` and
converts back. Store calls run inline on the event loop (uvloop): a lookup is tens of
microseconds of numba, far less than a thread hop, and running every store call on one thread
makes each of them (a delta application included) atomic with respect to lookups. Only file I/O
(reading and writing dumps) goes to a worker thread; the install/cut steps around it are inline.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the store (numba) and grpc are imported when a server starts, not by `recserve --help`
    from serving.ps.store import StoreConfig

log = logging.getLogger("recserve.ps")

SERVICE = "recserve.v1.EmbeddingPS"


@dataclass
class ServerConfig:
    """One PS shard process."""

    host: str = "127.0.0.1"
    """Interface to bind; loopback unless told otherwise."""
    port: int = 50061
    """gRPC port (0: the OS picks one; it is logged)."""
    metrics_port: int = 0
    """Prometheus /metrics HTTP port (0: off)."""
    load: str = ""
    """Dump to load before serving: a shard directory or a directory of shard-<i>-of-<n>/."""
    grace_s: float = 5.0
    """On SIGTERM/SIGINT, in-flight calls get this long to finish."""
    max_message_mb: int = 64
    """Max gRPC send/receive message size."""
    expire_every_s: float = 10.0
    """How often TTL expiry runs (only when store.ttl_s > 0)."""
    follow: str = ""
    """Model directory (<model_store>/<model>) to follow: serve its CURRENT version, switch when
    CURRENT changes, apply each new delta of the served version (serving/ps/follow.py)."""
    poll_s: float = 1.0
    """How often the follower looks for a new version or delta."""
    store: StoreConfig = field(default_factory=lambda: _store_config())
    """The shard's store (shard, num_shards, dim, capacity, optimizer, ...)."""


def _store_config(**kw) -> StoreConfig:
    from serving.ps.store import StoreConfig

    return StoreConfig(**kw)


class BadRequest(ValueError):
    """The request is malformed; maps to INVALID_ARGUMENT."""


def _signs(payload: bytes) -> np.ndarray:
    if not payload:
        raise BadRequest("empty request: no signs")
    if len(payload) % 8:
        raise BadRequest(f"signs is {len(payload)} bytes, not a multiple of 8 (uint64 little-endian)")
    return np.frombuffer(payload, dtype="<u8")


def _status(e: Exception, method: str):
    """The gRPC status and message for an exception raised by an RPC."""
    import grpc

    from serving.ps.persist import StoreError

    if isinstance(e, ValueError):  # BadRequest and the store's own argument checks
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, StoreError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(e)
    if isinstance(e, OSError):
        return grpc.StatusCode.UNAVAILABLE, f"I/O error: {e}"
    log.error("%s failed", method, exc_info=e)
    return grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(e).__name__}: {e}"


def _rpc(method):
    """The error boundary of every RPC: deadline check, then exceptions -> gRPC status."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        remaining = context.time_remaining()
        if remaining is not None and remaining <= 0:
            import grpc

            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the call started")
        try:
            return await method(self, request, context)
        except Exception as e:
            if type(e).__name__ == "AbortError":  # context.abort() inside the method
                raise
            await context.abort(*_status(e, method.__name__))

    return wrapper


class _Metrics:
    """Lookup latency histogram and id counter; store gauges are read at scrape time."""

    def __init__(self, store):
        from prometheus_client import CollectorRegistry, Counter, Histogram
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from serving.metrics import LATENCY_BUCKETS

        self.registry = CollectorRegistry()
        self.lookup_seconds = Histogram(
            "recserve_ps_lookup_seconds",
            "PS Lookup time in the server",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.lookup_ids = Counter("recserve_ps_lookup_ids", "Signs looked up", registry=self.registry)
        self.update_seconds = Histogram(
            "recserve_ps_update_seconds",
            "PS Update time in the server",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

        class StoreCollector:
            def collect(self):
                st = store.stats()
                for name, help_text in (
                    ("rows", "rows held"),
                    ("capacity", "row capacity"),
                    ("memory_bytes", "bytes of all store arrays"),
                    ("delta_seq", "last delta applied or cut"),
                ):
                    yield GaugeMetricFamily(f"recserve_ps_{name}", help_text, value=st[name])
                for name in ("hits", "misses", "inserts", "evictions", "expired"):
                    yield CounterMetricFamily(f"recserve_ps_{name}", f"signs {name}", value=st[name])

        self.registry.register(StoreCollector())


class EmbeddingPSServicer:
    """gRPC adapter of one ``EmbeddingStore``."""

    def __init__(self, store, metrics: _Metrics | None = None):
        from recserve.v1 import common_pb2, ps_pb2

        self.store = store
        self.metrics = metrics
        self.pb = ps_pb2
        self.common = common_pb2

    def _fp16(self, value: int) -> bool:
        """True for float16, False for float32; anything else is refused."""
        if value in (self.common.DTYPE_UNSPECIFIED, self.common.FLOAT32):
            return False
        if value == self.common.FLOAT16:
            return True
        raise BadRequest(f"unknown dtype {value}; use FLOAT32 (1) or FLOAT16 (2)")

    def _lookup_version(self):  # of the rows just returned: read under the lookup's lock, same thread
        version, seq = self.store.last_lookup_version
        return self.common.ModelVersion(version=version, delta_seq=seq)

    def _version(self):
        return self.common.ModelVersion(version=self.store.version, delta_seq=self.store.delta_seq)

    @_rpc
    async def Lookup(self, request, context):
        signs = _signs(request.signs)
        fp16 = self._fp16(request.dtype)
        t0 = time.perf_counter()
        rows, misses = self.store.lookup(signs, insert=request.insert)
        payload = (rows.astype(np.float16) if fp16 else rows).tobytes()
        if self.metrics is not None:
            self.metrics.lookup_seconds.observe(time.perf_counter() - t0)
            self.metrics.lookup_ids.inc(len(signs))
        return self.pb.LookupResponse(
            rows=payload,
            dim=self.store.config.dim,
            dtype=self.common.FLOAT16 if fp16 else self.common.FLOAT32,
            misses=misses,
            version=self._lookup_version(),
        )

    @_rpc
    async def Update(self, request, context):
        signs = _signs(request.signs)
        dim = self.store.config.dim
        want = len(signs) * dim * 4
        if len(request.grads) != want:
            raise BadRequest(
                f"grads is {len(request.grads)} bytes; expected {want} "
                f"(float32, {len(signs)} signs x dim {dim}, row-major)"
            )
        grads = np.frombuffer(request.grads, dtype="<f4").reshape(len(signs), dim)
        t0 = time.perf_counter()
        applied = self.store.apply_gradients(signs, grads, step=request.step)
        if self.metrics is not None:
            self.metrics.update_seconds.observe(time.perf_counter() - t0)
        return self.pb.UpdateResponse(applied=applied)

    @_rpc
    async def Stats(self, request, context):
        st = self.store.stats()
        return self.pb.StatsResponse(
            shard=st["shard"],
            num_shards=st["num_shards"],
            dim=st["dim"],
            rows=st["rows"],
            capacity=st["capacity"],
            memory_bytes=st["memory_bytes"],
            hits=st["hits"],
            misses=st["misses"],
            evictions=st["evictions"] + st["expired"],
            optimizer=st["optimizer"],
            version=self._version(),
        )

    @_rpc
    async def Dump(self, request, context):
        from serving.ps import persist

        if not request.path:
            raise BadRequest("dump path is empty")
        # cut/copy inline (consistent and atomic), write in a thread (lookups keep flowing)
        data = self.store.cut_delta() if request.delta else self.store.snapshot(copy=True)
        try:
            path = await asyncio.to_thread(persist.write_shard, request.path, data)
        except BaseException:
            if request.delta:
                self.store.restore_delta(data)
            raise
        return self.pb.DumpResponse(path=str(path), rows=len(data.signs), deleted=len(data.deleted))

    @_rpc
    async def Load(self, request, context):
        if not request.path:
            raise BadRequest("load path is empty")
        data = await asyncio.to_thread(self.store.read, request.path, request.delta)  # read + verify
        if request.delta:
            self.store.apply_delta_data(data)
        else:
            self.store.install(data)
        return self.pb.LoadResponse(rows=len(self.store), version=self._version())


def _warm_up(cfg: StoreConfig) -> None:
    """Load every kernel the RPCs use (compiled or from numba's cache) for the read-only arrays
    that protobuf payloads give, so the first real call is not the slow one."""
    from dataclasses import replace

    from serving.ps.store import EmbeddingStore

    scratch = EmbeddingStore(replace(cfg, capacity=16, min_count=1, shard=0, num_shards=1))
    signs = np.frombuffer(np.array([1, 2, 2, 3], dtype="<u8").tobytes(), dtype="<u8")
    grads = np.frombuffer(np.zeros((4, cfg.dim), dtype="<f4").tobytes(), dtype="<f4").reshape(4, cfg.dim)
    scratch.lookup(signs, insert=True)
    scratch.lookup(signs)
    scratch.apply_gradients(signs, grads)
    scratch.apply_gradients(signs[:1], grads[:1])


def _options(config: ServerConfig) -> list[tuple[str, int]]:
    size = config.max_message_mb * 1024 * 1024
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]


async def serve(config: ServerConfig, started: asyncio.Future | None = None) -> None:
    """Run one PS shard until SIGTERM/SIGINT (or until the task is cancelled)."""
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from recserve.v1 import ps_pb2_grpc
    from serving.metrics import start_metrics_server
    from serving.ps.store import EmbeddingStore

    store = EmbeddingStore(config.store)
    _warm_up(config.store)
    if config.load:
        t0 = time.perf_counter()
        store.load(config.load)
        log.info("loaded %d rows from %s in %.2fs", len(store), config.load, time.perf_counter() - t0)
    metrics = _Metrics(store)
    follower = None
    if config.follow:
        from serving.ps.follow import Follower

        follower = Follower(store, config.follow, registry=metrics.registry)
        for event in follower.poll():  # serve the published version (and its deltas) from the start
            log.info("follow: %s", event)
    server = grpc.aio.server(options=_options(config))
    ps_pb2_grpc.add_EmbeddingPSServicer_to_server(EmbeddingPSServicer(store, metrics), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if not port:
        raise OSError(f"cannot bind {config.host}:{config.port}")
    stop_metrics = start_metrics_server(config.metrics_port, config.host, metrics.registry)
    await server.start()
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    cfg = config.store
    log.info(
        "ps shard %d/%d serving on %s:%d (dim %d, capacity %d)",
        cfg.shard,
        cfg.num_shards,
        config.host,
        port,
        cfg.dim,
        cfg.capacity,
    )
    if started is not None:
        started.set_result(port)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread (tests)
            pass

    async def expire_loop():
        while True:
            await asyncio.sleep(config.expire_every_s)
            if n := store.expire():
                log.info("expired %d rows", n)

    async def follow_loop():
        while True:
            await asyncio.sleep(config.poll_s)
            try:  # file reads and checks off the loop; the store's lock makes each flip atomic
                for event in await loop.run_in_executor(None, follower.poll):
                    log.info("follow: %s", event)
            except Exception:  # keep serving what we have; the next poll retries
                log.exception("follow poll failed")

    expirer = asyncio.create_task(expire_loop()) if cfg.ttl_s > 0 else None
    following = asyncio.create_task(follow_loop()) if follower is not None else None
    try:
        await stop.wait()
        log.info("shutting down (grace %.1fs)", config.grace_s)
    finally:
        for task in (expirer, following):
            if task is not None:
                task.cancel()
        await health_servicer.enter_graceful_shutdown()
        await server.stop(config.grace_s)
        stop_metrics()


# ---- CLI ----------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file with ServerConfig fields (store: {...}); flags override it")
    p.add_argument("--shard", type=int, help="this shard's number (default 0)")
    p.add_argument("--num-shards", type=int, help="number of PS shards (default 1)")
    p.add_argument("--host", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="gRPC port (default 50061; 0 = any)")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (default 0 = off)")
    p.add_argument("--load", help="dump directory to load before serving")
    p.add_argument(
        "--follow",
        help="model directory <model_store>/<model>: serve CURRENT, follow new versions and deltas",
    )
    p.add_argument("--poll-s", type=float, help="how often --follow looks for versions/deltas (default 1 s)")
    p.add_argument("--dim", type=int, help="embedding dimension (default 16)")
    p.add_argument("--capacity", type=int, help="row capacity of this shard (default 1,000,000)")
    p.add_argument("--dtype", choices=["float32", "float16"], help="row storage type")
    p.add_argument("--optimizer", choices=["sgd", "adagrad", "adam", "ftrl"], help="sparse optimizer")
    p.add_argument("--lr", type=float, help="learning rate")
    p.add_argument("--init-scale", type=float, help="new rows are uniform(-s, s)")
    p.add_argument("--min-count", type=int, help="admission threshold (sightings before a row)")
    p.add_argument("--eviction", choices=["lru", "lfu"], help="eviction policy when full")
    p.add_argument("--ttl-s", type=float, help="expire rows untouched this long (0 = never)")
    p.add_argument("--schema-hash", help="feature-schema hash required of loaded dumps")
    p.add_argument("--log-level", default="INFO")


_SERVER_FLAGS = ("host", "port", "metrics_port", "load", "follow", "poll_s")
_STORE_FLAGS = (
    "shard",
    "num_shards",
    "dim",
    "capacity",
    "dtype",
    "init_scale",
    "min_count",
    "eviction",
    "ttl_s",
    "schema_hash",
)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    raw: dict = {}
    if args.config:
        import yaml

        with open(args.config) as f:
            raw = yaml.safe_load(f) or {}
    store = dict(raw.pop("store", {}) or {})
    optimizer = dict(store.pop("optimizer", {}) or {})
    raw.update({k: getattr(args, k) for k in _SERVER_FLAGS if getattr(args, k) is not None})
    store.update({k: getattr(args, k) for k in _STORE_FLAGS if getattr(args, k) is not None})
    if args.optimizer is not None:
        optimizer["name"] = args.optimizer
    if args.lr is not None:
        optimizer["lr"] = args.lr
    from serving.ps.optim import OptimizerConfig

    store["optimizer"] = OptimizerConfig(**optimizer)
    return ServerConfig(**raw, store=_store_config(**store))


def run(args: argparse.Namespace) -> int:
    import uvloop

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = config_from_args(args)
    except (TypeError, ValueError) as e:
        log.error("bad configuration: %s", e)
        return 2
    uvloop.run(serve(config))
    return 0
