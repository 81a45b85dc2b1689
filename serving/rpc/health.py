"""The one wait for a gRPC service to say SERVING (grpc.health.v1)."""

from __future__ import annotations

import time


def wait_serving(channel, timeout_s: float = 30.0, service: str = "", proc=None, log_path=None) -> None:
    """Poll grpc.health.v1 on a blocking ``channel`` until SERVING (TimeoutError after
    ``timeout_s``; RuntimeError with the log's tail when ``proc`` exits first). The one health wait."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    if isinstance(channel, str):  # an address
        with grpc.insecure_channel(channel) as ch:
            return wait_serving(ch, timeout_s, service, proc, log_path)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path and log_path.exists() else ""
            raise RuntimeError(f"process exited with {proc.returncode}:\n{tail}")
        try:
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.RpcError as e:
            last = e.code().name
        if time.monotonic() > deadline:
            raise TimeoutError(f"not SERVING after {timeout_s}s (last: {last})")
        time.sleep(0.05)
