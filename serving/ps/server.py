"""The ``EmbeddingPS`` gRPC service: one process per shard (``recserve ps``).

The servicer is thin: it checks and converts protobuf payloads, calls the ``EmbeddingStore`` and
converts back. Store calls run inline on the event loop (uvloop): a lookup is tens of
microseconds of numba, far less than a thread hop, and running every store call on one thread
makes each of them (a delta application included) atomic with respect to lookups. Only file I/O
(reading and writing dumps) goes to a worker thread; the install/cut steps around it are inline.

Never serve nothing: a shard following the model store (``--follow``) says NOT_SERVING on gRPC
health until it serves a version, and answers a Lookup then with UNAVAILABLE naming the shard and
why (no version published yet, or the follower's refusal); ``Stats`` carries the refusal.

Least privilege (``ps_access``, checked by the one ``rpc`` boundary): a serving shard (``--follow``)
answers ``Lookup`` and ``Stats`` (and health, reflection) only; ``Update``, ``Dump`` and ``Load`` are
PERMISSION_DENIED whatever the caller sends. A training shard answers them, and inserting lookups,
to callers holding the admin token (``--admin-token-file``; without one they are refused), and
``Dump``/``Load`` paths must stay under ``--data-root``. Plain lookups and ``Stats`` stay open on a
training shard: they change nothing, and benchmarks and tools read shards without the token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from model_store import shards
from model_store.layout import default_root
from serving.ps.config import StoreConfig
from serving.ps.follow import lower_thread_priority, not_serving_reason
from serving.ps.metrics import PSMetrics
from serving.rpc import convert
from serving.rpc.auth import Access, read_token_file
from serving.rpc.errors import NotServing, rpc

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
    pin: str = ""
    """With --follow: serve this version (and its deltas) instead of the one CURRENT names."""
    poll_s: float = 1.0
    """How often the follower looks for a new version or delta."""
    keep_previous_s: float = 30.0
    """With --follow: after a switch, the replaced version keeps answering the lookups that name
    it (scoring processes still on its dense model) until none has for this long."""
    admin_token_file: str = ""
    """Training shard: file holding the token that Update, Dump, Load and inserting lookups need
    (created 0600 by whoever starts the shard; `recserve train` does). Without it they are refused."""
    data_root: str = field(default_factory=default_root)
    """Training shard: Dump and Load paths must lie under this directory (symlinks resolved;
    relative paths are taken under it). Default: the model-store root ($RECSERVE_STORE or ./artifacts)."""
    tls_cert: str = ""
    """TLS: this server's certificate (PEM; with --tls-key). Without it the server speaks plaintext."""
    tls_key: str = ""
    """TLS: the certificate's private key (PEM, unencrypted, mode 0600)."""
    tls_client_ca: str = ""
    """mTLS: clients must present a certificate signed by this CA (PEM)."""
    store: StoreConfig = field(default_factory=StoreConfig)
    """The shard's store (shard, num_shards, dim, capacity, optimizer, ...)."""

    def __post_init__(self) -> None:
        self.tls()  # a missing file, or a key that is not the certificate's: say so now
        if self.admin_token_file and self.follow:
            raise ValueError(
                "--admin-token-file is for a training PS: a serving PS (--follow) has no RPC that writes"
            )
        if self.admin_token_file:
            read_token_file(self.admin_token_file)  # missing, empty or readable by others: say so now
        if self.pin and not self.follow:
            raise ValueError("--pin needs --follow")
        if self.load and self.follow:
            raise ValueError("--load and --follow exclude each other (--follow serves the model's versions)")
        if self.follow and isinstance(self.store, StoreConfig):
            check_serving_config(self.store)

    def endpoint(self):
        from serving.rpc.server import Endpoint

        return Endpoint(
            self.host, self.port, self.metrics_port, self.max_message_mb, self.grace_s, self.tls()
        )

    def tls(self):
        from serving.rpc.tls import ServerTLS

        return ServerTLS.of(self.tls_cert, self.tls_key, self.tls_client_ca)


OPEN = frozenset({"Lookup", "Stats"})
"""What every shard answers to anyone: reads."""
WRITES = frozenset({"Update", "Dump", "Load"})
"""What only a training shard answers, to callers holding its admin token."""


def ps_access(config: ServerConfig) -> Access:
    """The shard's policy: reads only when serving; reads plus token-guarded writes when training."""
    if config.follow:
        return Access("serving PS (--follow)", open=OPEN)
    token = read_token_file(config.admin_token_file) if config.admin_token_file else ""
    return Access(
        "training PS", open=OPEN, guarded=WRITES, token=token, root=Path(config.data_root).resolve()
    )


class EmbeddingPSServicer:
    """gRPC adapter of one ``EmbeddingStore`` (and of its ``Follower`` when it follows a model);
    ``access`` is the shard's ``ps_access`` policy."""

    def __init__(self, store, access: Access, metrics: PSMetrics | None = None, follower=None):
        from recserve.v1 import common_pb2, ps_pb2

        self.store = store
        self.access = access
        self.metrics = metrics
        self.follower = follower
        self.pb = ps_pb2
        self.common = common_pb2
        self._writable = asyncio.Event()  # clear while a full dump writes from the live arrays
        self._writable.set()
        self._dumping = asyncio.Lock()

    async def writable(self) -> None:
        """Wait while a full dump is being written: every change to the store (Update, inserting
        Lookups, Load, TTL expiry) waits here; lookups that only read do not. The change itself
        then runs with no await in between, so no dump starts under it."""
        while not self._writable.is_set():
            await self._writable.wait()

    def _version(self):
        return self.common.ModelVersion(version=self.store.version, delta_seq=self.store.delta_seq)

    @rpc
    async def Lookup(self, request, context):
        if self.follower is not None and not self.store.version:  # never default rows for no version
            raise NotServing(not_serving_reason(self.store, self.follower))
        signs = convert.signs_from_bytes(request.signs)
        fp16 = convert.wants_fp16(request.dtype)
        t0 = time.perf_counter()
        if request.insert and not getattr(self.store, "read_only", False):  # a new row is a write
            self.access.require("Lookup with insert", context)
            await self.writable()
        # answered from the version named, or refused (serving/ps/config.py check_holds)
        rows, misses, (version, seq) = self.store.rows_of(signs, request.insert, request.version)
        payload = convert.rows_to_bytes(rows, fp16)
        if self.metrics is not None:
            self.metrics.lookup_seconds.observe(time.perf_counter() - t0)
            self.metrics.lookup_ids.inc(len(signs))
        return self.pb.LookupResponse(
            rows=payload,
            dim=self.store.config.dim,
            dtype=self.common.FLOAT16 if fp16 else self.common.FLOAT32,
            misses=misses,
            version=self.common.ModelVersion(version=version, delta_seq=seq),  # what these rows are
        )

    @rpc
    async def Update(self, request, context):
        signs = convert.signs_from_bytes(request.signs)
        grads = convert.matrix_from_bytes(request.grads, len(signs), self.store.config.dim)
        await self.writable()
        t0 = time.perf_counter()
        applied = self.store.apply_gradients(signs, grads, step=request.step)
        if self.metrics is not None:
            self.metrics.update_seconds.observe(time.perf_counter() - t0)
        return self.pb.UpdateResponse(applied=applied)

    @rpc
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
            evictions=st["evictions"],
            expired=st["expired"],
            grows=st["grows"],
            optimizer=st["optimizer"],
            version=self._version(),
            refusal=self.follower.refusal if self.follower is not None else "",
            held=[self.common.ModelVersion(version=v, delta_seq=q) for v, q in st.get("held", ())],
        )

    @rpc
    async def Dump(self, request, context):
        path = self.access.path(request.path, "dump")
        async with self._dumping:
            if request.delta:  # the changed rows, copied inline (small); written in a thread
                data = self.store.cut_delta()
                try:
                    path = await asyncio.to_thread(shards.write_shard, path, data)
                except BaseException:
                    self.store.restore_delta(data)
                    raise
            else:  # written in a thread from views of the live arrays, changes paused meanwhile:
                # a copy first would double the shard's memory (keys, rows, optimizer state) at
                # every checkpoint; lookups that only read keep flowing
                self._writable.clear()
                try:
                    data = self.store.snapshot(copy=False)
                    path = await asyncio.to_thread(shards.write_shard, path, data)
                finally:
                    self._writable.set()
        return self.pb.DumpResponse(path=str(path), rows=len(data.signs), deleted=len(data.deleted))

    @rpc
    async def Load(self, request, context):  # a training shard's (a serving one follows the store)
        path = self.access.path(request.path, "load")
        data = await asyncio.to_thread(self.store.read, path, request.delta)  # read + verify
        await self.writable()
        if request.delta:
            self.store.apply_delta_data(data)
        else:
            self.store.install(data)
        return self.pb.LoadResponse(rows=len(self.store), version=self._version())


def check_serving_config(cfg: StoreConfig) -> None:
    """A serving PS maps an immutable version: the training store's policies do not apply."""
    given = [f"--{name}" for name, on in (("eviction", cfg.eviction != "none"), ("ttl-s", cfg.ttl_s > 0),
             ("min-count", cfg.min_count > 1), ("max-memory-gb", cfg.max_memory_gb > 0)) if on]  # fmt: skip
    if given:
        raise ValueError(
            f"{', '.join(given)}: not for a serving PS (--follow), which maps the version's files as "
            "they are; eviction and TTL are training policies (recserve train --eviction/--ttl-s)"
        )


async def serve(config: ServerConfig, started: asyncio.Future | None = None) -> None:
    """Run one PS shard until SIGTERM/SIGINT (or until the task is cancelled): open its store,
    start following the model (serving shard), answer gRPC with health kept true to what it
    serves, run the background loops (TTL expiry, follow polls), then stop within the grace."""
    from recserve.v1 import ps_pb2  # noqa: F401  (registers the service add_service looks up)
    from serving.rpc import server as rpc_server

    config.__post_init__()
    store = open_store(config)
    metrics = PSMetrics(store)
    follower = start_following(config, store, metrics.registry)
    servicer = EmbeddingPSServicer(store, ps_access(config), metrics, follower)
    running = await rpc_server.start_aio(config.endpoint(), SERVICE, servicer, metrics.registry)
    health = Health(running, store, follower)
    await health.update()
    log_listening(config, store, running.port)
    if started is not None:
        started.set_result(running.port)
    stop = rpc_server.stop_event_on_signals()
    loops = Background(config, servicer, health)
    try:
        await stop.wait()
    finally:
        loops.cancel()
        await rpc_server.stop_aio(running, config.grace_s)
        loops.shutdown()
        st = store.stats()
        log.info("ps shard %d: %d rows held; %d evicted, %d expired, grew %d times",
                 config.store.shard, st["rows"], st["evictions"], st["expired"], st["grows"])  # fmt: skip


def open_store(config: ServerConfig):
    """The shard's store: a serving shard (``--follow``) maps versions' files read-only (deltas in
    an overlay); a training one holds rows and optimizer state (compiled kernels: numba, warmed
    up here), loaded from ``--load`` when given."""
    if config.follow:
        from serving.ps.mapped import MappedStore

        return MappedStore(config.store, keep_s=config.keep_previous_s)
    from serving.ps.store import EmbeddingStore, warm_up

    store = EmbeddingStore(config.store)
    warm_up(config.store)
    if config.load:
        t0 = time.perf_counter()
        store.load(config.load)
        log.info("loaded %d rows from %s in %.2fs", len(store), config.load, time.perf_counter() - t0)
    return store


def start_following(config: ServerConfig, store, registry):
    """A serving shard's ``Follower``, having polled once so the published version (and its
    deltas) is served from the start; None for a training shard."""
    if not config.follow:
        return None
    from serving.ps.follow import Follower

    follower = Follower(store, config.follow, registry=registry, pin=config.pin)
    for event in follower.poll():
        log.info("follow: %s", event)
    return follower


class Health:
    """gRPC health SERVING exactly while the shard serves a version; a change is logged once."""

    def __init__(self, running, store, follower):
        self.running, self.store, self.follower = running, store, follower
        self.reason: str | None = None  # None: not set yet

    async def update(self) -> None:
        from serving.rpc import server as rpc_server

        reason = not_serving_reason(self.store, self.follower)
        if reason == self.reason:
            return
        if self.reason is None or bool(reason) != bool(self.reason):
            await rpc_server.set_serving_aio(self.running, not reason)
        self.reason = reason
        if reason:
            log.warning("NOT_SERVING: %s", reason)
        elif self.follower is not None:
            log.info("SERVING version %s (delta %d)", self.store.version, self.store.delta_seq)


def log_listening(config: ServerConfig, store, port: int) -> None:
    cfg = config.store
    log.info(
        "ps shard %d/%d listening on %s:%d (dim %d, %s)",
        cfg.shard, cfg.num_shards, config.host, port, cfg.dim,
        "serving mapped versions" if config.follow else
        f"capacity {store.capacity}, eviction {cfg.eviction}, memory limit "
        + (f"{cfg.max_memory_gb:g} GiB" if cfg.max_memory_gb else "none"),
    )  # fmt: skip


class Background:
    """The shard's loops on the event loop: TTL expiry (training, ``ttl_s > 0``) and follow polls
    (serving), whose reads, checksums and overlay builds run on one low-priority thread."""

    def __init__(self, config: ServerConfig, servicer: EmbeddingPSServicer, health: Health):
        self.config, self.servicer, self.health = config, servicer, health
        self.store, self.follower = servicer.store, servicer.follower
        self.pool = None
        self.tasks = []
        if config.store.ttl_s > 0:
            self.tasks.append(asyncio.create_task(self.expire_loop()))
        if self.follower is not None:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(1, "follow", initializer=lower_thread_priority)
            self.tasks.append(asyncio.create_task(self.follow_loop()))

    async def expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.expire_every_s)
            await self.servicer.writable()
            if n := self.store.expire():
                log.info("expired %d rows (%d in all)", n, self.store.expired)

    async def follow_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.config.poll_s)
            try:  # flips are atomic on the loop's side
                for event in await loop.run_in_executor(self.pool, self.follower.poll):
                    log.info("follow: %s", event)
                for version in await loop.run_in_executor(self.pool, self.store.release_idle):
                    log.info("released version %s: no lookup named it for %gs", version, self.store.keep_s)
            except Exception:  # keep serving what we have; the next poll retries
                log.exception("follow poll failed")
            await self.health.update()

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
