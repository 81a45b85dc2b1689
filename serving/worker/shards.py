"""The worker's view of the PS shards: one backend per shard, and the router that splits signs.

``ShardBackend`` is the whole interface the worker needs (``dim``, ``lookup``, ``update``), so a
shard can be an in-process store (``LocalShard``, tests and single-process training) or a PS
process over gRPC (``GrpcShard``). Backends may also expose ``version`` ((version, delta_seq) of
the last answer) and ``close()``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from features.hashing import shard_of

_MAX_MESSAGE = 256 * 1024 * 1024


@runtime_checkable
class ShardBackend(Protocol):
    dim: int

    def lookup(self, signs: np.ndarray, insert: bool) -> np.ndarray:
        """Rows float32 (n, dim) for uint64 ``signs``; ``insert`` gives unseen signs a row."""
        ...

    def update(self, signs: np.ndarray, grads: np.ndarray) -> None:
        """Apply float32 (n, dim) gradients with the shard's sparse optimizer."""
        ...


class ShardError(RuntimeError):
    """A shard call failed; ``unavailable`` is True when the shard could not be reached in time."""

    def __init__(self, message: str, unavailable: bool = False):
        super().__init__(message)
        self.unavailable = unavailable


class HashRouter:
    """Splits signs by owning shard with ``features.hashing.shard_of`` (the one routing function)."""

    def __init__(self, num_shards: int):
        if num_shards < 1:
            raise ValueError("need at least one shard")
        self.num_shards = num_shards

    def split(self, signs: np.ndarray) -> list[np.ndarray | None]:
        """Per shard, the positions in ``signs`` it owns (None: all of them, single shard)."""
        if self.num_shards == 1:
            return [None]
        owner = shard_of(signs, self.num_shards)
        order = np.argsort(owner, kind="stable")
        counts = np.bincount(owner, minlength=self.num_shards)
        return np.split(order, np.cumsum(counts)[:-1])


class LocalShard:
    """An in-process ``EmbeddingStore`` as a shard."""

    def __init__(self, store):
        self.store = store
        self.dim = store.config.dim

    def lookup(self, signs: np.ndarray, insert: bool) -> np.ndarray:
        return self.store.lookup(signs, insert=insert)[0]

    def update(self, signs: np.ndarray, grads: np.ndarray) -> None:
        self.store.apply_gradients(signs, grads)

    @property
    def version(self) -> tuple[str, int]:
        return self.store.version, self.store.delta_seq


class GrpcShard:
    """One ``recserve ps`` process over gRPC; every call carries a ``timeout_s`` deadline.

    The blocking gRPC client releases the GIL while it waits, so the worker's fan-out threads
    query several shards at once."""

    def __init__(self, address: str, timeout_s: float = 5.0):
        import grpc

        from recserve.v1 import common_pb2, ps_pb2, ps_pb2_grpc

        self.address = address
        self.timeout_s = timeout_s
        self._grpc = grpc
        self._pb = ps_pb2
        self._float32 = common_pb2.FLOAT32
        opts = [
            ("grpc.max_send_message_length", _MAX_MESSAGE),
            ("grpc.max_receive_message_length", _MAX_MESSAGE),
            # a restarted PS is found again within ~2 s (gRPC's default backoff grows to 120 s)
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        self.channel = grpc.insecure_channel(address, options=opts)
        self.stub = ps_pb2_grpc.EmbeddingPSStub(self.channel)
        self._dim: int | None = None
        self.version: tuple[str, int] | None = None
        """(version, delta_seq) of the last answer from this shard (None before the first)."""

    def _call(self, method, request, timeout_s: float | None = None):
        try:
            return method(request, timeout=timeout_s or self.timeout_s)
        except self._grpc.RpcError as e:
            code = e.code()
            unavailable = code in (self._grpc.StatusCode.UNAVAILABLE, self._grpc.StatusCode.DEADLINE_EXCEEDED)
            what = "unavailable" if unavailable else "failed"
            raise ShardError(
                f"PS shard {self.address} {what}: {code.name}: {e.details()}", unavailable
            ) from None

    @property
    def dim(self) -> int:
        if self._dim is None:
            self._dim = int(self.stats()["dim"])
        return self._dim

    def stats(self, timeout_s: float | None = None) -> dict:
        """The shard's Stats (shard, num_shards, dim, rows, ...) as a dict."""
        resp = self._call(self.stub.Stats, self._pb.StatsRequest(), timeout_s)
        self.version = (resp.version.version, int(resp.version.delta_seq))
        return {
            "shard": resp.shard,
            "num_shards": resp.num_shards,
            "dim": resp.dim,
            "rows": resp.rows,
            "capacity": resp.capacity,
            "optimizer": resp.optimizer,
        }

    def lookup(self, signs: np.ndarray, insert: bool) -> np.ndarray:
        request = self._pb.LookupRequest(
            signs=np.ascontiguousarray(signs, dtype="<u8").tobytes(), dtype=self._float32, insert=insert
        )
        resp = self._call(self.stub.Lookup, request)
        self.version = (resp.version.version, int(resp.version.delta_seq))
        if resp.dtype not in (0, self._float32) or len(resp.rows) != len(signs) * resp.dim * 4:
            raise ShardError(
                f"PS shard {self.address} answered {len(resp.rows)} bytes for {len(signs)} signs"
            )
        return np.frombuffer(resp.rows, dtype="<f4").reshape(len(signs), resp.dim)

    def update(self, signs: np.ndarray, grads: np.ndarray) -> None:
        request = self._pb.UpdateRequest(
            signs=np.ascontiguousarray(signs, dtype="<u8").tobytes(),
            grads=np.ascontiguousarray(grads, dtype="<f4").tobytes(),
        )
        self._call(self.stub.Update, request)

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the shard's channel connects (raises ShardError after ``timeout_s``)."""
        try:
            self._grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
        except self._grpc.FutureTimeoutError:
            raise ShardError(f"PS shard {self.address} unreachable after {timeout_s:.0f}s", True) from None

    def close(self) -> None:
        self.channel.close()
