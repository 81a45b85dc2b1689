"""The ``EmbeddingPS`` gRPC service: one process per shard, in one of two roles: a training shard
(``recserve ps``, ``TrainingShardConfig``) or a serving shard (``recserve ps-serve``,
``ServingShardConfig``).

``serve`` starts a shard in named steps (``serving.ps.process``): ``open_store`` (a training
``TableShard``, or a serving shard's ``MappedTableShard``), ``start_following`` (a serving shard's
``Follower``, polled once so it serves the published version from the start), the gRPC server with
``Health`` kept true to what is served, and the ``Background`` loops (TTL expiry; follow polls at
each notice).

The servicer is thin: it checks and converts protobuf payloads, calls the store and converts
back. Store calls run inline on the event loop (uvloop): a lookup is tens of microseconds (numba
kernels in training, numpy over mapped arrays when serving), far less than a thread hop, and
running every training-store call on one thread makes each of them (a delta application
included) atomic with respect to lookups. What is slow runs on a worker thread: reading and
writing dumps (the install/cut steps around it are inline), and a serving shard's follow polls
(reads, paced checksums and overlay builds; the snapshot flip is one reference).

Never serve nothing: a serving shard, following the model store, says NOT_SERVING on gRPC
health until it serves a version, and answers a Lookup then with UNAVAILABLE naming the shard and
why (no version published yet, or the follower's refusal); ``Stats`` carries the refusal.

Least privilege (``ps_access``, checked by the one ``rpc`` boundary): a serving shard answers ``Lookup`` and ``Stats`` (and health, reflection) only; ``Update``,
``UpdateLookup``, ``Assign``, ``Dump`` and ``Load`` are PERMISSION_DENIED whatever the caller
sends. A training shard answers them, and inserting lookups, to callers holding the admin token
(``--admin-token-file``; without one they are refused), and ``Dump``/``Load`` paths must stay under
``--data-root``. Plain lookups and ``Stats`` stay open on a training shard: they change nothing,
and benchmarks and tools read shards without the token.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, cast

from model_store import shards
from serving.ps.config import ServingShardConfig, ShardConfig
from serving.ps.follow import not_serving_reason
from serving.ps.metrics import PSMetrics
from serving.ps.process import Background, Health, log_listening, open_store, start_following
from serving.rpc import convert
from serving.rpc.auth import Access, read_token_file
from serving.rpc.errors import BadRequest, NotServing, rpc

if TYPE_CHECKING:
    from recserve.v1.common_pb2 import DType

log = logging.getLogger("recserve.ps")

SERVICE = "recserve.v1.EmbeddingPS"

OPEN = frozenset({"Lookup", "Stats"})
"""What every shard answers to anyone: reads."""
WRITES = frozenset({"Update", "UpdateLookup", "Assign", "Dump", "Load"})
"""What only a training shard answers, to callers holding its admin token."""


def ps_access(config: ShardConfig) -> Access:
    """The shard's policy: reads only when serving; reads plus token-guarded writes when training."""
    if isinstance(config, ServingShardConfig):
        return Access("serving PS (recserve ps-serve)", open=OPEN)
    token = read_token_file(config.admin_token_file) if config.admin_token_file else ""
    return Access(
        "training PS", open=OPEN, guarded=WRITES, token=token, root=Path(config.data_root).resolve()
    )


class EmbeddingPSServicer:
    """gRPC adapter of one ``TableShard`` (and of its ``Follower`` when it follows a model);
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
        signs, fp16 = self._lookup_args(request)
        if request.insert and self._inserts(context):
            await self.writable()
        return self._lookup(request, signs, fp16)

    @rpc
    async def Update(self, request, context):
        signs, grads = self._update_args(request)
        await self.writable()
        return self._update(request, signs, grads)

    @rpc
    async def UpdateLookup(self, request, context):
        """Update, then Lookup, both parts parsed and checked before either runs, with no await
        between them: the rows answered hold this update and no part of another write. A lookup
        that then fails (a shard out of memory for the rows it would insert) leaves the update
        applied, as an Update followed by that Lookup would."""
        has_update = bool(request.update.signs or request.update.grads)
        has_lookup = bool(request.lookup.signs)
        if not (has_update or has_lookup):
            raise BadRequest("empty request: neither update nor lookup signs")
        update = self._update_args(request.update) if has_update else None
        lookup = self._lookup_args(request.lookup) if has_lookup else None
        if has_lookup and request.lookup.insert:
            self._inserts(context)
        await self.writable()
        return self.pb.UpdateLookupResponse(
            update=self._update(request.update, *update) if update is not None else None,
            lookup=self._lookup(request.lookup, *lookup) if lookup is not None else None,
        )

    def _lookup_args(self, request):
        """A LookupRequest's signs and wire type, checked; a shard serving no version refuses."""
        if self.follower is not None and not self.store.version:  # never default rows for no version
            raise NotServing(not_serving_reason(self.store, self.follower))
        return convert.signs_from_bytes(request.signs), convert.wants_fp16(request.dtype)

    def _inserts(self, context) -> bool:
        """An inserting lookup writes (a new row) where the store can: it needs the token then."""
        if getattr(self.store, "read_only", False):
            return False
        self.access.require("Lookup with insert", context)
        return True

    def _lookup(self, request, signs, fp16: bool):
        t0 = time.perf_counter()
        # answered from the version named, or refused (serving/ps/config.py check_holds)
        dtype, qparams = (convert.FLOAT16 if fp16 else convert.FLOAT32), b""
        # a serving shard answers as mapped (an inserting lookup goes on to rows_of, which refuses it)
        if request.stored and not request.insert and hasattr(self.store, "stored_rows_of"):
            stored, misses, (version, seq) = self.store.stored_rows_of(signs, request.version)
            dtype, payload, qparams = convert.stored_to_bytes(stored)
        else:  # a training shard holds float32 or float16 rows: stored is its own dtype
            rows, misses, (version, seq) = self.store.rows_of(signs, request.insert, request.version)
            if request.stored:
                dtype = convert.WIRE[str(rows.dtype)]
            payload = convert.rows_to_bytes(rows, dtype == convert.FLOAT16)
        if self.metrics is not None:
            self.metrics.lookup_seconds.observe(time.perf_counter() - t0)
            self.metrics.lookup_ids.inc(len(signs))
        return self.pb.LookupResponse(
            rows=payload,
            dim=self.store.config.dim,
            dtype=cast("DType", dtype),
            misses=misses,
            version=self.common.ModelVersion(version=version, delta_seq=seq),  # what these rows are
            qparams=qparams,
        )

    def _update_args(self, request):
        signs = convert.signs_from_bytes(request.signs)
        return signs, convert.matrix_from_bytes(request.grads, len(signs), self.store.config.dim)

    def _update(self, request, signs, grads):
        t0 = time.perf_counter()
        applied = self.store.apply_gradients(signs, grads, step=request.step)
        if self.metrics is not None:
            self.metrics.update_seconds.observe(time.perf_counter() - t0)
        return self.pb.UpdateResponse(applied=applied)

    @rpc
    async def Assign(self, request, context):
        signs = convert.signs_from_bytes(request.signs)
        dim, names = self.store.config.dim, self.store.config.optimizer.state_names
        rows = convert.matrix_from_bytes(request.rows, len(signs), dim)
        if request.state and len(request.state) != len(names):
            raise ValueError(f"{len(request.state)} state matrices for optimizer state {list(names)}")
        given = zip(names, request.state, strict=False)  # none given: the state stays
        state = {n: convert.matrix_from_bytes(b, len(signs), dim) for n, b in given}
        await self.writable()
        assigned = self.store.assign(signs, rows, state or None)  # ValueError: INVALID_ARGUMENT
        return self.pb.AssignResponse(assigned=assigned)

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


async def serve(config: ShardConfig, started: asyncio.Future | None = None) -> None:
    """Run one PS shard until SIGTERM/SIGINT (or until the task is cancelled): open its store,
    start following the model (serving shard), answer gRPC with health kept true to what it
    serves, run the background loops (TTL expiry, follow polls), then stop within the grace."""
    from recserve.v1 import ps_pb2  # noqa: F401  (registers the service add_service looks up)
    from serving.rpc import server as rpc_server

    config.__post_init__()
    store = open_store(config, config.store_config())
    metrics = PSMetrics(store)
    follower = start_following(config, store, metrics.registry)
    servicer = EmbeddingPSServicer(store, ps_access(config), metrics, follower)
    running = await rpc_server.start_aio(config.server.endpoint(), SERVICE, servicer, metrics.registry)
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
        await rpc_server.stop_aio(running, config.server.grace_s)
        loops.shutdown()
        st = store.stats()
        log.info("ps shard %d: %d rows held; %d evicted, %d expired, grew %d times",
                 store.config.shard, st["rows"], st["evictions"], st["expired"], st["grows"])  # fmt: skip
