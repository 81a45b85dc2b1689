"""The one client of an ``EmbeddingPS`` shard. It is also the worker's shard backend (``rows``,
``update``, ``dim``, ``version``), so training, serving and benchmarks talk to a PS one way.

It speaks numpy: ``lookup(signs) -> (rows float32 (n, dim), misses)``, ``rows(signs, insert)``,
(rows travel as the shard stores them -- float32, float16, or an int8 version's codes with their
fp16 scale and bias, 20 bytes a row at dim 16 against 64 -- and are decoded here with the one
decoding, ``model_store.quant``, so they are the values a co-located gather reads),
``update(signs, grads)``, ``update_lookup(signs, grads, lookup)`` (both in one round trip: a
training step's), ``assign``, ``stats() -> dict``, ``dump``/``load``. Every call carries a deadline
(``timeout_s``). Every failure is a ``ShardError`` naming the shard, with the gRPC status name in
``code`` and ``unavailable`` set when the shard could not be reached in time (the one client error
convention; the worker's servers map it to UNAVAILABLE / INTERNAL). A shard that is up but serves
no version says so (``not_serving``), and its message -- naming the shard and why -- is kept as is.

Given the admin token file of a training shard (``token_file``), every call carries the token
(``serving.rpc.auth``): ``update``, ``update_lookup``, ``assign``, ``dump``, ``load`` and
inserting lookups need it; plain lookups and ``stats`` do not, and sending it there costs one
header.

With ``tls`` (``serving.rpc.tls.ClientTLS``) the channel speaks TLS, or mTLS when it holds a client
certificate; an unreachable shard's error says what this client spoke, since a plaintext client
against a TLS server (or a CA that did not sign its certificate) looks like "unreachable" to gRPC.

The blocking gRPC client releases the GIL while it waits, so the worker's fan-out threads query
several shards at once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np

from serving.rpc import convert
from serving.rpc.auth import read_token_file, token_metadata
from serving.rpc.errors import not_serving
from serving.rpc.health import wait_serving
from serving.rpc.server import grpc_options
from serving.rpc.tls import ClientTLS, channel, describe

if TYPE_CHECKING:
    from recserve.v1.common_pb2 import DType

_UNAVAILABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED")
_PASSED_ON = ("RESOURCE_EXHAUSTED", "PERMISSION_DENIED", "UNAUTHENTICATED")


class ShardError(RuntimeError):
    """A PS call failed: ``code`` is the gRPC status name ("" when not from gRPC),
    ``unavailable`` is True when the shard could not be reached in time or serves no version,
    ``not_serving`` when it is up but serves no version (the message says why)."""

    def __init__(self, message: str, unavailable: bool = False, code: str = "", not_serving: bool = False):
        super().__init__(message)
        self.unavailable = unavailable or not_serving
        self.code = code
        self.not_serving = not_serving

    @property
    def grpc_status(self) -> str:
        """How a server that called this shard answers its own client (a shard out of room stays
        RESOURCE_EXHAUSTED all the way to the trainer; a refused token stays a refusal)."""
        if self.code in _PASSED_ON:
            return self.code
        return "UNAVAILABLE" if self.unavailable else "INTERNAL"


class PSClient:
    """Blocking client of one PS shard at ``target`` ("host:port"); ``token_file``: the shard's
    admin token file (a training shard's writes need it); ``tls``: TLS settings (None: plaintext)."""

    def __init__(
        self, target: str, timeout_s: float = 5.0, max_message_mb: int = 256, token_file: str = "",
        tls: ClientTLS | None = None,
    ):  # fmt: skip
        import grpc

        from recserve.v1 import ps_pb2, ps_pb2_grpc

        self.target = self.address = target
        self.token_file = token_file
        self.tls = tls
        self.metadata = token_metadata(read_token_file(token_file)) if token_file else ()
        """Metadata of every call (the admin token, when given), also for raw stub calls."""
        self.timeout_s = timeout_s
        self._grpc = grpc
        self._pb = ps_pb2
        opts = [
            *grpc_options(max_message_mb),
            # a restarted PS is found again within ~2 s (gRPC's default backoff grows to 120 s)
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        self.channel = channel(target, opts, tls)
        self.stub = ps_pb2_grpc.EmbeddingPSStub(self.channel)
        self._dim: int | None = None
        self.version: tuple[str, int] | None = None
        """(version, delta_seq) of the last answer from this shard (None before the first)."""

    def _call(self, method, request, timeout_s: float | None = None):
        try:
            return method(request, timeout=timeout_s or self.timeout_s, metadata=self.metadata)
        except self._grpc.RpcError as e:
            code = e.code().name
            if not_serving(e):  # the shard's own message names it and says why
                raise ShardError(f"{e.details()} (PS {self.target})", code=code, not_serving=True) from None
            unavailable = code in _UNAVAILABLE
            what = f"unavailable (client speaks {describe(self.tls)})" if unavailable else "failed"
            raise ShardError(
                f"PS shard {self.target} {what}: {code}: {e.details()}", unavailable, code
            ) from None

    # ---- lookups and updates -------------------------------------------------------------------
    def lookup(
        self, signs, insert: bool = False, dtype: str = "stored", timeout_s: float | None = None,
        version: str = "",
    ):  # fmt: skip
        """(rows float32 (n, dim), misses) for uint64 ``signs`` of ``version`` ("" = the shard's
        newest); ``insert`` gives unseen signs a row. ``dtype``: what travels -- "stored" (the
        shard's own row type, the fewest bytes), or "float32" / "float16" (converted by the
        shard); the values are the same unless float16 is asked of float32 rows."""
        rows, misses, _ = self._lookup(signs, insert, dtype, timeout_s, version)
        return rows, misses

    def rows(
        self, signs: np.ndarray, insert: bool, version: str = "", timeout_s: float | None = None
    ) -> tuple[np.ndarray, tuple[str, int]]:
        """The worker's backend verb: rows float32 (n, dim) and the (version, delta seq) they were
        read from. ``timeout_s``: what is left of the caller's deadline (the call's deadline is
        the shorter of it and this client's ``timeout_s``)."""
        if timeout_s is not None:
            timeout_s = max(min(timeout_s, self.timeout_s), 1e-3)
        rows, _, answered = self._lookup(signs, insert, "stored", timeout_s, version)
        return rows, answered

    def _lookup(self, signs, insert: bool, dtype: str, timeout_s: float | None, version: str):
        stored = dtype == "stored"
        request = self._pb.LookupRequest(
            signs=convert.signs_to_bytes(signs), insert=insert, version=version, stored=stored,
            dtype=cast("DType", convert.FLOAT32 if stored else convert.wire_dtype(dtype)),
        )  # fmt: skip
        resp = self._call(self.stub.Lookup, request, timeout_s)
        rows, answered = self._rows(resp, len(signs))
        return rows, resp.misses, answered

    def _rows(self, resp, n: int) -> tuple[np.ndarray, tuple[str, int]]:
        """The rows of a LookupResponse for ``n`` signs, and the (version, delta seq) they are."""
        answered = (resp.version.version, int(resp.version.delta_seq))
        self.version = answered
        try:
            rows = convert.stored_from_bytes(resp.dtype, resp.rows, resp.qparams, (n, resp.dim))
            return rows.decoded(), answered
        except ValueError as e:
            raise ShardError(f"PS shard {self.target} answered a bad payload: {e}") from None

    def update(self, signs, grads, step: int = 0, timeout_s: float | None = None) -> int:
        """Apply float32 gradients (n, dim) with the shard's optimizer; returns the signs updated."""
        return self._call(self.stub.Update, self._update_request(signs, grads, step), timeout_s).applied

    def _update_request(self, signs, grads, step: int = 0):
        return self._pb.UpdateRequest(
            signs=convert.signs_to_bytes(signs),
            grads=np.ascontiguousarray(grads, dtype="<f4").tobytes(),
            step=step,
        )

    def update_lookup(
        self, signs: np.ndarray, grads: np.ndarray, lookup: np.ndarray, timeout_s: float | None = None
    ) -> tuple[np.ndarray, tuple[str, int]]:
        """One round trip: apply float32 gradients (n, dim) of ``signs``, then the rows (inserting)
        of ``lookup`` read after them, as ``rows`` answers them. Either may be empty."""
        wanted = self._pb.LookupRequest(signs=convert.signs_to_bytes(lookup), insert=True, stored=True)
        request = self._pb.UpdateLookupRequest(update=self._update_request(signs, grads), lookup=wanted)
        resp = self._call(self.stub.UpdateLookup, request, timeout_s)
        if not len(lookup):
            return np.empty((0, self.dim), np.float32), self.version or ("", -1)
        return self._rows(resp.lookup, len(lookup))

    def assign(self, signs, rows, state=(), timeout_s: float | None = None) -> int:
        """Set float32 rows (n, dim) and their optimizer state (one (n, dim) matrix per state name,
        in the shard's order; none: kept) for distinct signs; returns the rows written."""
        f32 = lambda a: np.ascontiguousarray(a, dtype="<f4").tobytes()  # noqa: E731
        request = self._pb.AssignRequest(
            signs=convert.signs_to_bytes(signs), rows=f32(rows), state=[f32(s) for s in state]
        )
        return self._call(self.stub.Assign, request, timeout_s).assigned

    # ---- state ---------------------------------------------------------------------------------
    @property
    def dim(self) -> int:
        if self._dim is None:
            self._dim = int(self.stats()["dim"])
        return self._dim

    def stats(self, timeout_s: float | None = None) -> dict:
        """The shard's Stats (shard, num_shards, dim, rows, capacity, ..., version, delta_seq)."""
        from google.protobuf.json_format import MessageToDict

        resp = self._call(self.stub.Stats, self._pb.StatsRequest(), timeout_s)
        self.version = (resp.version.version, int(resp.version.delta_seq))
        out = MessageToDict(resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
        for k in ("rows", "capacity", "memory_bytes", "hits", "misses", "evictions", "expired", "grows"):
            out[k] = int(out.get(k, 0))
        out["delta_seq"] = int(resp.version.delta_seq)
        out["version"] = resp.version.version
        out["held"] = [(h.version, int(h.delta_seq)) for h in resp.held]
        return out

    def dump(self, path: str, delta: bool = False, timeout_s: float = 300.0):
        return self._call(self.stub.Dump, self._pb.DumpRequest(path=str(path), delta=delta), timeout_s)

    def load(self, path: str, delta: bool = False, timeout_s: float = 300.0):
        return self._call(self.stub.Load, self._pb.LoadRequest(path=str(path), delta=delta), timeout_s)

    # ---- life cycle ----------------------------------------------------------------------------
    def wait_connected(self, timeout_s: float = 30.0) -> None:
        """Block until the shard accepts calls, serving a version or not (ShardError, unavailable,
        after ``timeout_s``)."""
        try:
            self._grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
        except self._grpc.FutureTimeoutError:
            raise ShardError(
                f"PS shard {self.target}: not reachable after {timeout_s}s (client speaks "
                f"{describe(self.tls)})", True, "UNAVAILABLE",
            ) from None  # fmt: skip

    def health(self) -> str:
        """The shard's gRPC health: "SERVING", "NOT_SERVING", or why the check failed ("UNAVAILABLE")."""
        from serving.rpc.health import check

        return check(self.channel)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Block until the shard's health says SERVING (ShardError, unavailable, after ``timeout_s``)."""
        try:
            wait_serving(self.channel, timeout_s)
        except TimeoutError as e:
            raise ShardError(
                f"PS shard {self.target}: {e} (client speaks {describe(self.tls)})", True, "UNAVAILABLE"
            ) from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
