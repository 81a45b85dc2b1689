"""Blocking client of an ``EmbeddingWorker`` process, with the core's verbs.

``WorkerClient`` has the same ``forward`` as ``core.EmbeddingWorker``, so the scoring core can use
either. One channel per client, reused by every call
(thread-safe); each call carries a deadline. Errors come back as the core raises them:
INVALID_ARGUMENT -> ValueError, NOT_FOUND -> KeyError, a shard that serves no version ->
``NotServing`` with the shard's own message, UNAVAILABLE / DEADLINE_EXCEEDED -> ConnectionError,
anything else -> RuntimeError (the ``grpc.RpcError`` is the ``__cause__``). ``tls``: the
worker's TLS settings (``serving.rpc.tls.ClientTLS``; None: plaintext); an unreachable worker's
error says what this client spoke.
"""

from __future__ import annotations

import numpy as np

from features.batch import CompactBatch
from serving.rpc.errors import NotServing, not_serving
from serving.rpc.failover import Attempt, FailedOver, Failover, is_host_port
from serving.rpc.tls import ClientTLS, channel, describe
from serving.worker.core import ForwardResult

_MAX_MESSAGE = 256 * 1024 * 1024


class WorkerClient:
    """Client of the worker at ``address`` ("host:port")."""

    def __init__(self, address: str, timeout_s: float = 5.0, tls: ClientTLS | None = None):
        import grpc

        from recserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

        self.address = address
        self.tls = tls
        self.timeout_s = timeout_s
        self._grpc = grpc
        self._pb = worker_pb2
        self._common = common_pb2
        opts = [
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            # a restarted worker is found again within ~2 s (gRPC's default backoff grows to 120 s)
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        self.channel = channel(address, opts, tls)
        self.stub = worker_pb2_grpc.EmbeddingWorkerStub(self.channel)
        self._dtypes = {"float32": common_pb2.FLOAT32, "float16": common_pb2.FLOAT16}

    def _call(self, method, request, timeout_s: float | None):
        try:
            return method(request, timeout=timeout_s or self.timeout_s)
        except self._grpc.RpcError as e:
            code, details = e.code(), e.details()
            if not_serving(e):  # says which shard serves no version, and why
                raise NotServing(details) from e
            message = f"worker {self.address}: {code.name}: {details}"
            if code == self._grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(message) from e
            if code == self._grpc.StatusCode.NOT_FOUND:
                raise KeyError(message) from e
            if code in (self._grpc.StatusCode.UNAVAILABLE, self._grpc.StatusCode.DEADLINE_EXCEEDED):
                raise ConnectionError(f"{message} (client speaks {describe(self.tls)})") from e
            raise RuntimeError(message) from e

    def forward(
        self,
        batch: bytes | CompactBatch,
        dtype: str = "float32",
        timeout_s: float | None = None,
        version: str = "",
    ) -> ForwardResult:
        """Pooled embeddings (float32 (rows, slots, dim), writable) of a compact batch (its
        encoded bytes, or a ``CompactBatch`` that is encoded here). ``dtype`` is the wire type;
        ``version`` pins the embedding version read ("" = each shard's newest)."""
        if isinstance(batch, CompactBatch):
            from features.codec import encode

            batch = encode(batch)
        if dtype not in self._dtypes:
            raise ValueError(f"dtype must be float32|float16, got {dtype!r}")
        request = self._pb.ForwardRequest(batch=batch, dtype=self._dtypes[dtype], version=version)
        resp = self._call(self.stub.Forward, request, timeout_s)
        wire = "<f2" if resp.dtype == self._common.FLOAT16 else "<f4"
        shape = (resp.num_rows, resp.num_slots, resp.dim)
        pooled = np.frombuffer(resp.pooled, dtype=wire).reshape(shape).astype(np.float32)  # a writable copy
        shards = [(v.version, int(v.delta_seq)) for v in resp.shards]
        return ForwardResult(pooled, (resp.version.version, int(resp.version.delta_seq)), shards)

    def stats(self, timeout_s: float | None = None) -> dict:
        r = self._call(self.stub.Stats, self._pb.WorkerStatsRequest(), timeout_s)
        return {
            "num_shards": r.num_shards,
            "dim": r.dim,
            "schema": r.schema,
            "schema_hash": r.schema_hash,
            "version": (r.version.version, int(r.version.delta_seq)),
        }

    def health(self) -> str:
        """The worker's gRPC health: "SERVING", "NOT_SERVING", or why the check failed."""
        from serving.rpc.health import check

        return check(self.channel)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Block until the worker's health service says SERVING (raises TimeoutError)."""
        from serving.rpc.health import wait_serving

        try:
            wait_serving(self.channel, timeout_s)
        except TimeoutError as e:
            raise TimeoutError(f"worker {self.address}: {e} (client speaks {describe(self.tls)})") from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> WorkerClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WorkerSet(Failover[WorkerClient]):
    """Several embedding workers behind one frontend (``--worker a:1|b:1``), each able to answer
    every lookup: ``forward`` goes round robin to the SERVING ones and fails over to the next one
    within the call's deadline when a worker is unreachable, too slow (its host's link down) or
    serves no version (``serving.rpc.failover``). When none answers, the error keeps the class a
    single worker's would have: ``NotServing`` when every worker said so, else ``ConnectionError``."""

    def __init__(self, clients: list[WorkerClient], health_poll_s: float = 0.5):
        super().__init__(clients, "embedding workers", health_poll_s)
        self.timeout_s = max(c.timeout_s for c in self.replicas)
        self.tls = clients[0].tls

    def forward(
        self,
        batch: bytes | CompactBatch,
        dtype: str = "float32",
        timeout_s: float | None = None,
        version: str = "",
    ) -> ForwardResult:
        """``WorkerClient.forward`` on one worker, failing over to the others."""
        if isinstance(batch, CompactBatch):
            from features.codec import encode

            batch = encode(batch)
        try:
            result, _ = self.call(
                lambda w, left: w.forward(batch, dtype, timeout_s=left, version=version),
                self.timeout_s if timeout_s is None else timeout_s,
                _classify,
            )
        except FailedOver as e:
            if e.errors and all(isinstance(x, NotServing) for x in e.errors):
                raise NotServing(str(e)) from e.errors[-1]
            raise ConnectionError(str(e)) from (e.errors[-1] if e.errors else None)
        return result

    def start(self) -> WorkerSet:
        """One health pass now (a worker that is down leaves the rotation before the first
        request), then a pass every ``health_poll_s`` in a daemon thread."""
        self.check()
        self.start_polling()
        return self


def _classify(e: BaseException) -> Attempt | None:
    if isinstance(e, ConnectionError):  # unreachable or too slow: out of the rotation until SERVING
        return Attempt(retry=True, down=True, status="UNAVAILABLE")
    if isinstance(e, NotServing):  # its shards serve no (or not the pinned) version: try another
        return Attempt(retry=True)
    return None


def parse_workers(spec: str) -> list[str]:
    """``"a:1|b:1"`` -> ``["a:1", "b:1"]``; a ValueError naming the problem for an address that is
    not HOST:PORT or one given twice."""
    addresses = [a.strip() for a in spec.split("|")]
    for a in addresses:
        if not is_host_port(a):
            raise ValueError(f"--worker {spec!r}: {a!r} is not HOST:PORT (several workers: a:1|b:1)")
    if len(set(addresses)) != len(addresses):
        raise ValueError(f"--worker {spec!r}: an address is given twice")
    return addresses


def connect_workers(spec: str, timeout_s: float = 5.0, tls: ClientTLS | None = None):
    """A ``WorkerClient`` for ``host:port``, a started ``WorkerSet`` for ``a:1|b:1``."""
    clients = [WorkerClient(a, timeout_s=timeout_s, tls=tls) for a in parse_workers(spec)]
    return clients[0] if len(clients) == 1 else WorkerSet(clients).start()
