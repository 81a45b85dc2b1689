"""Clients of one ``EmbeddingPS`` shard: ``PSClient`` (blocking) and ``AsyncPSClient`` (asyncio).

Both speak numpy: ``lookup(signs) -> (rows float32 (n, dim), misses)``, ``update(signs, grads)``,
``stats() -> dict``; every call carries a deadline (``timeout_s``). gRPC errors surface as
``grpc.RpcError`` with the server's status and message.
"""

from __future__ import annotations

import numpy as np

_MAX_MESSAGE = 64 * 1024 * 1024
_FLOAT16 = 2  # recserve.v1.DType.FLOAT16


def channel_options(max_message: int = _MAX_MESSAGE) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message), ("grpc.max_receive_message_length", max_message)]


def _signs_bytes(signs) -> bytes:
    return np.ascontiguousarray(signs, dtype="<u8").tobytes()


def _lookup_request(signs, insert: bool, dtype: str):
    from recserve.v1 import common_pb2, ps_pb2

    if dtype not in ("float32", "float16"):
        raise ValueError(f"unknown dtype {dtype!r}")
    wire = common_pb2.FLOAT16 if dtype == "float16" else common_pb2.FLOAT32
    return ps_pb2.LookupRequest(signs=_signs_bytes(signs), dtype=wire, insert=insert)


def _rows(resp, n: int) -> tuple[np.ndarray, int]:
    """Rows as float32 (a read-only view of the payload when it was sent as float32)."""
    rows = np.frombuffer(resp.rows, dtype="<f2" if resp.dtype == _FLOAT16 else "<f4").reshape(n, resp.dim)
    return (rows.astype(np.float32) if resp.dtype == _FLOAT16 else rows), resp.misses


def _update_request(signs, grads, step: int):
    from recserve.v1 import ps_pb2

    return ps_pb2.UpdateRequest(
        signs=_signs_bytes(signs), grads=np.ascontiguousarray(grads, dtype="<f4").tobytes(), step=step
    )


def _stats(resp) -> dict:
    from google.protobuf.json_format import MessageToDict

    out = MessageToDict(resp, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for k in ("rows", "capacity", "memory_bytes", "hits", "misses", "evictions"):
        out[k] = int(out.get(k, 0))
    out["delta_seq"] = int(resp.version.delta_seq)
    out["version"] = resp.version.version
    return out


class PSClient:
    """Blocking client of one PS shard at ``target`` ("host:port")."""

    def __init__(self, target: str, timeout_s: float = 2.0):
        import grpc

        from recserve.v1 import ps_pb2_grpc

        self.target = target
        self.timeout_s = timeout_s
        self.channel = grpc.insecure_channel(target, options=channel_options())
        self.stub = ps_pb2_grpc.EmbeddingPSStub(self.channel)

    def lookup(self, signs, insert: bool = False, dtype: str = "float32", timeout_s: float | None = None):
        """(rows float32 (n, dim), misses) for ``signs`` (uint64)."""
        resp = self.stub.Lookup(_lookup_request(signs, insert, dtype), timeout=timeout_s or self.timeout_s)
        return _rows(resp, len(signs))

    def update(self, signs, grads, step: int = 0, timeout_s: float | None = None) -> int:
        """Apply float32 gradients (n, dim); returns the distinct signs updated."""
        return self.stub.Update(
            _update_request(signs, grads, step), timeout=timeout_s or self.timeout_s
        ).applied

    def stats(self, timeout_s: float | None = None) -> dict:
        from recserve.v1 import ps_pb2

        return _stats(self.stub.Stats(ps_pb2.StatsRequest(), timeout=timeout_s or self.timeout_s))

    def dump(self, path: str, delta: bool = False, timeout_s: float = 300.0):
        from recserve.v1 import ps_pb2

        return self.stub.Dump(ps_pb2.DumpRequest(path=str(path), delta=delta), timeout=timeout_s)

    def load(self, path: str, delta: bool = False, timeout_s: float = 300.0):
        from recserve.v1 import ps_pb2

        return self.stub.Load(ps_pb2.LoadRequest(path=str(path), delta=delta), timeout=timeout_s)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Block until the shard's health service says SERVING (raises TimeoutError)."""
        wait_serving(self.channel, timeout_s)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncPSClient:
    """asyncio client of one PS shard (grpc.aio); same methods as ``PSClient``, awaited."""

    def __init__(self, target: str, timeout_s: float = 2.0):
        import grpc

        from recserve.v1 import ps_pb2_grpc

        self.target = target
        self.timeout_s = timeout_s
        self.channel = grpc.aio.insecure_channel(target, options=channel_options())
        self.stub = ps_pb2_grpc.EmbeddingPSStub(self.channel)

    async def lookup(
        self, signs, insert: bool = False, dtype: str = "float32", timeout_s: float | None = None
    ):
        resp = await self.stub.Lookup(
            _lookup_request(signs, insert, dtype), timeout=timeout_s or self.timeout_s
        )
        return _rows(resp, len(signs))

    async def update(self, signs, grads, step: int = 0, timeout_s: float | None = None) -> int:
        resp = await self.stub.Update(
            _update_request(signs, grads, step), timeout=timeout_s or self.timeout_s
        )
        return resp.applied

    async def stats(self, timeout_s: float | None = None) -> dict:
        from recserve.v1 import ps_pb2

        return _stats(await self.stub.Stats(ps_pb2.StatsRequest(), timeout=timeout_s or self.timeout_s))

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncPSClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def wait_serving(channel, timeout_s: float = 30.0, service: str = "") -> None:
    """Poll grpc.health.v1 on a blocking ``channel`` until SERVING or ``timeout_s`` passes."""
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.RpcError as e:
            last = e.code().name
        time.sleep(0.05)
    raise TimeoutError(f"PS not SERVING after {timeout_s}s (last: {last})")
