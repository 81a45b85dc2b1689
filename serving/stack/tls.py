"""TLS of the local stack (``recserve up --tls``), kept in its state file (stack.json ``tls``).

``create`` makes a fresh CA and certificates under ``<run_dir>/tls`` (``serving.rpc.tls.local_pki``:
a server certificate for the stack's host and loopback, and with ``client_auth`` a client
certificate; keys 0600, the CA's key never written). Every PS shard and the worker serve with the
server pair (``server_flags``), requiring the stack's client certificate when ``client_auth``
(mTLS); the worker's PS connections, the scoring handler (``scoring_fields`` in scoring.json), the
controller and ``recserve`` tools reading the stack (``client``) present it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from serving.rpc.tls import ClientTLS, ServerTLS, local_pki

if TYPE_CHECKING:
    from serving.stack.state import StackState


def create(directory: str | Path, host: str, client_auth: bool) -> dict[str, dict[str, str]]:
    """New certificates under ``directory``; returns the state entry naming them."""
    server, client = local_pki(directory, [host], client_auth)
    return {"server": server.to_dict(), "client": client.to_dict()}


def client(state: StackState) -> ClientTLS | None:
    """What a client of the stack's PS shards and worker presents (None: the stack is plaintext)."""
    return ClientTLS.from_dict((state.tls or {}).get("client"))


def server_flags(state: StackState, worker: bool = False) -> list[str]:
    """The TLS flags of a PS shard, or of the worker (also its ``--ps-tls-*`` client side)."""
    server = ServerTLS.from_dict((state.tls or {}).get("server"))
    if server is None:
        return []
    if not worker:
        return server.flags()
    tls = client(state)
    if tls is None:
        raise ValueError("the stack's TLS has a server side but no client side (the worker's --ps-tls-*)")
    return server.flags() + tls.flags("--ps-tls-")


def scoring_fields(state: StackState) -> dict[str, str]:
    """The ``ScoringConfig`` TLS fields of the stack's scoring handler ({} when plaintext)."""
    tls = client(state)
    return {"tls_ca": tls.ca, "tls_cert": tls.cert, "tls_key": tls.key} if tls else {}
