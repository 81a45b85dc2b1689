"""gRPC health (grpc.health.v1) as a client: the one check, the one wait for SERVING, and the one
loop that keeps a service's own health equal to that of the services it depends on."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc

    from serving.rpc.tls import ClientTLS

log = logging.getLogger("recserve.rpc")


def check(channel: grpc.Channel, service: str = "", timeout_s: float = 1.0) -> str:
    """The health status of ``service`` on a blocking ``channel``: "SERVING", "NOT_SERVING", ...,
    or the gRPC status code name when the check itself fails ("UNAVAILABLE": not reachable)."""
    return _check(channel, service, timeout_s)[0]


def _check(channel: grpc.Channel, service: str, timeout_s: float) -> tuple[str, str]:
    """(``check``'s answer, gRPC's reason when the check itself failed, else "")."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        resp = health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[attr-defined]  # stubs lack it
            health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
        )
    except grpc.RpcError as e:
        return e.code().name, e.details() or ""
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status), ""


def wait_serving(
    channel: grpc.Channel | str,
    timeout_s: float = 30.0,
    service: str = "",
    proc: subprocess.Popen[bytes] | None = None,
    log_path: Path | None = None,
    tls: ClientTLS | None = None,
) -> None:
    """Poll grpc.health.v1 on a blocking ``channel`` until SERVING (TimeoutError after
    ``timeout_s``; RuntimeError with the log's tail when ``proc`` exits first). The one health wait.
    ``channel`` may be an address, opened with ``tls`` (``serving.rpc.tls.ClientTLS``; None: plaintext)."""
    from serving.rpc import tls as tls_mod

    if isinstance(channel, str):  # an address
        with tls_mod.channel(channel, tls=tls) as ch:
            try:
                return wait_serving(ch, timeout_s, service, proc, log_path)
            except TimeoutError as e:
                raise TimeoutError(f"{e} (client speaks {tls_mod.describe(tls)})") from None
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path and log_path.exists() else ""
            raise RuntimeError(f"process exited with {proc.returncode}:\n{tail}")
        last, why = _check(channel, service, 1.0)
        if last == "SERVING":
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"not SERVING after {timeout_s}s (last: {last}{f': {why}' if why else ''})")
        time.sleep(0.05)


def mirror(
    probes: dict[str, Callable[[], str]], set_serving: Callable[[bool, str], None], interval_s: float = 0.5
) -> threading.Event:
    """Keep a service SERVING exactly while every service it depends on says SERVING: a daemon
    thread calls each of ``probes`` (name -> a function returning a health status, e.g. a
    ``PSClient``'s ``health``) every ``interval_s`` and calls ``set_serving(serving, why)`` when the
    answer changes (``why`` names those not serving; it is logged too). Returns the ``threading.Event`` that stops it."""
    stop = threading.Event()

    def loop() -> None:
        last: dict[str, str] | None = None
        while True:
            down = {name: status for name, probe in probes.items() if (status := probe()) != "SERVING"}
            if down != last:
                why = ", ".join(f"{n} is {s}" for n, s in down.items())
                set_serving(not down, why)
                if down:
                    log.warning("NOT_SERVING: %s", why)
                else:
                    log.info("SERVING: %s", ", ".join(probes))
                last = down
            if stop.wait(interval_s):
                return

    threading.Thread(target=loop, name="health-mirror", daemon=True).start()
    return stop
