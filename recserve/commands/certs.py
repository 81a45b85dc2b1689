"""``recserve certs DIR --hosts a,b``: the TLS material of a deployment across hosts -- a fresh CA,
a server certificate valid for the names (and addresses) clients dial, and a client certificate
for mTLS -- written by ``serving.rpc.tls.local_pki``, the same code as ``recserve up --tls``.

The CA's key is never written: nothing else can be signed with it. Adding a name later means a new
CA and new certificates for every server and client (run this again, then roll the pods)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field


@dataclass
class CertsConfig:
    """``recserve certs``."""

    out: str = field(default="", metadata={"positional": True, "help": "directory to write the files to"})
    """Directory to write ca.pem, server.pem, server.key, client.pem and client.key to (made 0700)."""
    hosts: list[str] = field(default_factory=list)
    """Names and IP addresses the server certificate is valid for: those its clients dial (it is
    always valid for 127.0.0.1, localhost and ::1 as well)."""
    client_auth: bool = True
    """Also a client certificate, for servers that require one (--tls-client-ca: mTLS)."""

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("give the DIRECTORY to write the certificates to")
        if not self.hosts:
            raise ValueError("give --hosts: the names (and addresses) clients dial the servers by")


def run(config: CertsConfig) -> int:
    from serving.rpc.tls import LOCAL_HOSTS, local_pki

    try:
        server, client = local_pki(config.out, config.hosts, client_auth=config.client_auth)
    except OSError as e:
        print(f"recserve certs: cannot write to {config.out}: {e}", file=sys.stderr)
        return 1
    mtls = bool(client.cert)
    print(f"CA      {client.ca} (its key was not kept)")
    print(f"server  {server.cert} {server.key}: valid for {', '.join([*config.hosts, *LOCAL_HOSTS])}")
    if mtls:
        print(f"client  {client.cert} {client.key}")
    print(f"servers take  --tls-cert {server.cert} --tls-key {server.key}"
          + (f" --tls-client-ca {client.ca}" if mtls else ""))  # fmt: skip
    print(f"clients take  --tls-ca {client.ca}" + (f" --tls-cert {client.cert} --tls-key {client.key}" if mtls else "")
          + " (the worker's to its shards: --ps-tls-*)")  # fmt: skip
    return 0


CONFIG = CertsConfig
