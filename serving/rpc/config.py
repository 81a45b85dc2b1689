"""The listening part of every gRPC server's config (``ServerConfig``: interface, ports, message
size, grace, TLS), nested -- not copied -- in each role's config: the training and the serving PS
shard (``serving.ps.config``) and the embedding worker (``serving.worker.server.WorkerServerConfig``).
Its fields are flags of each of those commands (``--host``, ``--port``, ``--tls-cert``, ...); a
role gives its own defaults (its port) as the nested field's default. No gRPC import here:
``--help`` stays quick."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.rpc.server import Endpoint
    from serving.rpc.tls import ServerTLS


@dataclass
class ServerConfig:
    """Where and how one gRPC server listens."""

    host: str = "127.0.0.1"
    """Interface to bind; loopback unless told otherwise."""
    port: int = 0
    """gRPC port (0: the OS picks one; it is logged)."""
    metrics_port: int = 0
    """Prometheus /metrics HTTP port (0: off)."""
    grace_s: float = 5.0
    """On SIGTERM/SIGINT, in-flight calls get this long to finish."""
    max_message_mb: int = 64
    """Max gRPC send/receive message size."""
    tls_cert: str = ""
    """TLS: this server's certificate (PEM; with --tls-key). Without it the server speaks plaintext."""
    tls_key: str = ""
    """TLS: the certificate's private key (PEM, unencrypted, mode 0600)."""
    tls_client_ca: str = ""
    """mTLS: clients must present a certificate signed by this CA (PEM)."""

    def __post_init__(self) -> None:
        self.tls()  # a missing file, or a key that is not the certificate's: say so now

    def endpoint(self) -> Endpoint:
        """The ``serving.rpc.server.Endpoint`` this config describes."""
        from serving.rpc.server import Endpoint

        return Endpoint(
            self.host, self.port, self.metrics_port, self.max_message_mb, self.grace_s, self.tls()
        )

    def tls(self) -> ServerTLS | None:
        from serving.rpc.tls import ServerTLS

        return ServerTLS.of(self.tls_cert, self.tls_key, self.tls_client_ca)
