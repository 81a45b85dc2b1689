"""TLS on real gRPC servers on loopback (a PS shard and a worker, each in this process on its own
thread, with certificates made here by ``serving.rpc.tls``): a TLS client is answered; a plaintext
client, a client trusting another CA and (mTLS) a client without a certificate fail fast with an
error saying what the client spoke; the worker reaches TLS shards and serves TLS itself. Plus the
local PKI's files and the configuration errors that name the bad file."""

from __future__ import annotations

import contextlib
import stat
import threading
import time

import numpy as np
import pytest

from features.schema import dump_schema
from serving.ps.client import PSClient, ShardError
from serving.ps.shard import TableShardConfig
from serving.ps.spec import TableSpec
from serving.rpc.health import wait_serving
from serving.rpc.tls import ClientTLS, ServerTLS, issue_cert, local_pki, make_ca
from serving.worker.client import WorkerClient
from tests.helpers import ps_in_thread, wait_until
from tests.serving.helpers import SCHEMA, ranking_batch

DIM = 4
SIGNS = np.array([1, 2, 3], np.uint64)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """The stack's PKI (mTLS) plus a stranger: another CA with its own client certificate."""
    d = tmp_path_factory.mktemp("pki")
    server, client = local_pki(d / "ours", ["127.0.0.1"], client_auth=True)
    other = make_ca("another CA")
    (d / "other-ca.pem").write_bytes(other.cert)
    cert, key = issue_cert(other, "stranger", client=True).write(d, "stranger")
    return {"server": server, "client": client, "dir": d,
            "stranger": ClientTLS(client.ca, str(cert), str(key)),  # right CA, cert from another
            "wrong_ca": ClientTLS(str(d / "other-ca.pem"), client.cert, client.key)}  # fmt: skip


@contextlib.contextmanager
def ps_server(tls: ServerTLS | None):
    """A training PS shard (0 of 1) serving on a free loopback port on a thread of its own."""
    from serving.ps.config import TrainingShardConfig
    from serving.rpc.config import ServerConfig

    fields = tls.to_dict() if tls else {}
    server = ServerConfig(grace_s=0.1, **{f"tls_{k}": v for k, v in fields.items()})
    cfg = TrainingShardConfig(server=server, store=TableShardConfig(table=TableSpec(dim=DIM, capacity=1000)))
    with ps_in_thread(cfg) as address:
        yield address


@pytest.fixture(scope="module")
def mtls_ps(pki):
    with ps_server(pki["server"]) as address:
        yield address


def _fails_fast(client, match: str, within_s: float = 3.0) -> None:
    t0 = time.monotonic()
    with pytest.raises(ShardError, match=match) as e:
        client.stats()
    assert e.value.unavailable and time.monotonic() - t0 < within_s  # refused, not timed out
    client.close()


# ---- the PS over TLS -------------------------------------------------------------------------------
def test_an_mtls_ps_answers_a_client_with_the_stacks_certificates(mtls_ps, pki):
    with PSClient(mtls_ps, timeout_s=5, tls=pki["client"]) as c:
        rows, misses = c.lookup(SIGNS)
        assert rows.shape == (3, DIM) and misses == 3
        assert c.stats()["dim"] == DIM
        wait_serving(c.channel, 5)
    wait_serving(mtls_ps, 5, tls=pki["client"])  # the health wait by address


def test_a_plaintext_client_against_a_tls_ps_fails_fast_saying_it_spoke_plaintext(mtls_ps):
    _fails_fast(PSClient(mtls_ps, timeout_s=10), r"unavailable \(client speaks plaintext\): UNAVAILABLE")
    with pytest.raises(TimeoutError, match=r"not SERVING after 0.5s .*\(client speaks plaintext\)"):
        wait_serving(mtls_ps, 0.5)


def test_a_client_trusting_another_ca_fails_on_the_servers_certificate(mtls_ps, pki):
    _fails_fast(PSClient(mtls_ps, timeout_s=10, tls=pki["wrong_ca"]), "CERTIFICATE_VERIFY_FAILED")


def test_mtls_refuses_a_client_without_a_certificate_or_with_one_from_another_ca(mtls_ps, pki):
    no_cert = ClientTLS(pki["client"].ca)
    _fails_fast(PSClient(mtls_ps, timeout_s=10, tls=no_cert), r"client speaks TLS with CA .*: UNAVAILABLE")
    _fails_fast(PSClient(mtls_ps, timeout_s=10, tls=pki["stranger"]), "UNAVAILABLE")


def test_tls_without_client_auth_answers_any_client_trusting_its_ca(pki):
    server = ServerTLS(pki["server"].cert, pki["server"].key)  # no --tls-client-ca
    with ps_server(server) as address:
        with PSClient(address, timeout_s=5, tls=ClientTLS(pki["client"].ca)) as c:
            assert c.stats()["dim"] == DIM
        _fails_fast(PSClient(address, timeout_s=10), "client speaks plaintext")


def test_a_tls_client_against_a_plaintext_ps_fails_fast(pki):
    with ps_server(None) as address:
        with PSClient(address, timeout_s=5) as c:
            assert c.stats()["dim"] == DIM
        _fails_fast(PSClient(address, timeout_s=10, tls=pki["client"]), "Tls handshake failed")


# ---- the worker: a TLS client of the shards, a TLS server itself ----------------------------------
@contextlib.contextmanager
def worker_server(ps: str, schema_path, **tls_flags):
    from serving.rpc.config import ServerConfig
    from serving.worker.server import WorkerServerConfig, serve

    schema_path.write_text(dump_schema(SCHEMA))
    server = {k: v for k, v in tls_flags.items() if not k.startswith("ps_")}
    client = {k: v for k, v in tls_flags.items() if k.startswith("ps_")}
    cfg = WorkerServerConfig(ps=(ps,), schema=str(schema_path), ps_timeout_s=5, health_poll_s=0.1,
                       server=ServerConfig(grace_s=0.1, **server), **client)  # fmt: skip
    stop, ports, codes = threading.Event(), [], []
    thread = threading.Thread(target=lambda: codes.append(serve(cfg, stop, ports.append)), daemon=True)
    thread.start()
    try:
        wait_until(lambda: ports or codes, 60, "the worker listening (or exited)")
        assert ports, f"worker exited with {codes}"
        yield f"127.0.0.1:{ports[0]}"
    finally:
        stop.set()
        thread.join(10)


def test_the_worker_over_tls_shards_serves_forward_over_mtls(mtls_ps, pki, tmp_path):
    server, client = pki["server"], pki["client"]
    flags = {"tls_cert": server.cert, "tls_key": server.key, "tls_client_ca": server.client_ca,
             "ps_tls_ca": client.ca, "ps_tls_cert": client.cert, "ps_tls_key": client.key}  # fmt: skip
    with worker_server(mtls_ps, tmp_path / "schema.yaml", **flags) as address:
        with WorkerClient(address, timeout_s=5, tls=client) as w:
            w.wait_ready(30)  # SERVING: its health mirrors the TLS shard's
            batch = ranking_batch()
            res = w.forward(batch)
            assert res.pooled.shape == (batch.num_rows, len(SCHEMA.sparse), DIM)
        with WorkerClient(address, timeout_s=10) as plain:
            t0 = time.monotonic()
            with pytest.raises(ConnectionError, match=r"UNAVAILABLE: .*\(client speaks plaintext\)"):
                plain.forward(batch)
            assert time.monotonic() - t0 < 3


def test_a_worker_without_ps_tls_settings_cannot_start_over_tls_shards_and_says_why(mtls_ps):
    from serving.worker.core import connect

    with pytest.raises(ShardError, match=r"not reachable after 1.0s \(client speaks plaintext\)"):
        connect([mtls_ps], SCHEMA, timeout_s=1.0)


# ---- certificates and configuration ----------------------------------------------------------------
def test_local_pki_writes_private_keys_0600_and_no_ca_key(pki):
    from cryptography import x509

    ours = pki["dir"] / "ours"
    assert sorted(p.name for p in ours.iterdir()) == ["ca.pem", "client.key", "client.pem", "server.key",
                                                      "server.pem"]  # fmt: skip
    assert stat.S_IMODE(ours.stat().st_mode) == 0o700
    for key in ("client.key", "server.key"):
        assert stat.S_IMODE((ours / key).stat().st_mode) == 0o600
    cert = x509.load_pem_x509_certificate((ours / "server.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {str(ip) for ip in san.get_values_for_type(x509.IPAddress)} == {"127.0.0.1", "::1"}
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    server, client = local_pki(pki["dir"] / "plain-tls", client_auth=False)
    assert server.client_ca == "" and client.cert == "" and client.ca.endswith("ca.pem")


def test_bad_tls_files_are_refused_at_configuration_naming_the_file(tmp_path, pki):
    from serving.rpc.config import ServerConfig

    server = pki["server"]
    with pytest.raises(ValueError, match=r"cannot read the TLS private key .*missing.key: No such file"):
        ServerConfig(tls_cert=server.cert, tls_key=str(tmp_path / "missing.key"))
    with pytest.raises(ValueError, match="needs both --tls-cert and --tls-key"):
        ServerConfig(tls_cert=server.cert)
    loose = tmp_path / "loose.key"
    loose.write_bytes(open(server.key, "rb").read())
    loose.chmod(0o644)
    with pytest.raises(ValueError, match=r"TLS private key .*loose.key has mode 0644: .*chmod 600"):
        ServerConfig(tls_cert=server.cert, tls_key=str(loose))
    with pytest.raises(ValueError, match=r"client.key does not belong to the certificate .*server.pem"):
        ServerConfig(tls_cert=server.cert, tls_key=pki["client"].key)
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match=r"TLS client CA .*not.pem is not PEM"):
        ServerConfig(tls_cert=server.cert, tls_key=server.key, tls_client_ca=str(not_pem))
    with pytest.raises(ValueError, match="client certificate needs its key"):
        ClientTLS(server.client_ca, pki["client"].cert)


def test_the_flags_the_stack_passes_are_the_configs_own(pki):
    """``ServerTLS.flags`` / ``ClientTLS.flags`` parse, with the real CLI, into the same settings."""
    from recserve import config
    from recserve.cli import build_parser
    from serving.worker.server import WorkerServerConfig

    server, client = pki["server"], pki["client"]
    argv = ["worker", "--ps", "127.0.0.1:1", *server.flags(), *client.flags("--ps-tls-")]
    cfg = config.from_args(WorkerServerConfig, build_parser("worker").parse_args(argv))
    assert cfg.server.tls() == server and cfg.ps_tls() == client
