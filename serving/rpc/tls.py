"""TLS for every recserve gRPC server and client, written once: the server side (``ServerTLS``:
certificate, key, optional client CA for mTLS), the client side (``ClientTLS``: the CA that signed
the server's certificate, optional client certificate and key), the one channel opener every
client uses (``channel``), and a small local PKI (``make_ca``, ``issue_cert``, ``local_pki``) for
``recserve up --tls`` and the tests.

Both sides are checked when they are built, not at the first call: a missing file, a file that is
not PEM, a private key that group or others can read (``serving.rpc.auth.read_secret``, as for the
admin token) or a key that does not belong to its certificate is a ``ValueError`` naming the file.
A client and a server that disagree (plaintext against TLS, a CA that did not sign the server's
certificate, no client certificate for an mTLS server) fail the call fast -- the handshake fails,
the call gets UNAVAILABLE with gRPC's reason, and the client's message says what it spoke
(``ClientTLS.describe``).

``local_pki`` makes a throwaway CA (its key is never written: nothing else can be signed with it),
one server certificate for the given hosts (IP and DNS SANs) and, for mTLS, one client certificate.
Keys are EC P-256, written 0600 in a 0700 directory.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

from serving.rpc.auth import read_secret

if TYPE_CHECKING:
    import grpc
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.types import (
        CertificateIssuerPrivateKeyTypes,
        CertificatePublicKeyTypes,
        PrivateKeyTypes,
    )

ChannelOptions = Sequence[tuple[str, int | str]]  # gRPC channel arguments, e.g. ``grpc_options``

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
"""The names a certificate from ``local_pki`` is always valid for."""


def _read_pem(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path}: {e.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ValueError(f"{what} {path} is not PEM (no -----BEGIN line)")
    return data


def _load_cert(path: str, what: str) -> tuple[bytes, x509.Certificate]:
    from cryptography import x509

    data = _read_pem(path, what)
    try:
        return data, x509.load_pem_x509_certificate(data)
    except ValueError as e:
        raise ValueError(f"{what} {path} is not a PEM certificate: {e}") from None


def _load_key(path: str, what: str) -> tuple[bytes, PrivateKeyTypes]:
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    data = read_secret(path, what)
    try:
        return data, load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as e:  # TypeError: encrypted
        raise ValueError(f"{what} {path} is not an unencrypted PEM private key: {e}") from None


def _pair(cert_path: str, key_path: str, what: str) -> tuple[bytes, bytes]:
    """(certificate chain PEM, key PEM), the key checked to belong to the certificate."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    cert_pem, cert = _load_cert(cert_path, f"{what} certificate")
    key_pem, key = _load_key(key_path, f"{what} private key")
    spki = (Encoding.DER, PublicFormat.SubjectPublicKeyInfo)
    if cert.public_key().public_bytes(*spki) != key.public_key().public_bytes(*spki):
        raise ValueError(f"{what} private key {key_path} does not belong to the certificate {cert_path}")
    return cert_pem, key_pem


@dataclass(frozen=True)
class ServerTLS:
    """A server's TLS: its certificate (chain) and key, and optionally the CA whose certificates
    its clients must present (mTLS)."""

    cert: str
    key: str
    client_ca: str = ""

    def __post_init__(self) -> None:
        _pair(self.cert, self.key, "TLS")
        if self.client_ca:
            _load_cert(self.client_ca, "TLS client CA")

    @classmethod
    def of(cls, cert: str = "", key: str = "", client_ca: str = "") -> ServerTLS | None:
        """From a config's ``--tls-cert``, ``--tls-key``, ``--tls-client-ca`` (None: plaintext)."""
        if not (cert or key or client_ca):
            return None
        if not (cert and key):
            raise ValueError("TLS needs both --tls-cert and --tls-key (--tls-client-ca adds mTLS to them)")
        return cls(cert, key, client_ca)

    def credentials(self) -> grpc.ServerCredentials:
        """The one place server credentials are built."""
        import grpc

        cert_pem, key_pem = _pair(self.cert, self.key, "TLS")
        client_ca = _read_pem(self.client_ca, "TLS client CA") if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(key_pem, cert_pem)], root_certificates=client_ca, require_client_auth=bool(client_ca)
        )

    def describe(self) -> str:
        return "TLS, client certificates required" if self.client_ca else "TLS"

    def flags(self) -> list[str]:
        """The ``recserve ps``, ``ps-serve`` and ``worker`` flags that give a server these settings."""
        out = ["--tls-cert", self.cert, "--tls-key", self.key]
        return out + (["--tls-client-ca", self.client_ca] if self.client_ca else [])

    @classmethod
    def from_dict(cls, d: dict[str, str] | None) -> ServerTLS | None:
        return cls(**d) if d else None

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class ClientTLS:
    """A client's TLS: the CA that signed the server's certificate ("" = the system's roots) and,
    for an mTLS server, this client's certificate and key."""

    ca: str = ""
    cert: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("a TLS client certificate needs its key, and a key its certificate")
        if self.ca:
            _load_cert(self.ca, "TLS CA")
        if self.cert:
            _pair(self.cert, self.key, "TLS client")

    @classmethod
    def of(cls, ca: str = "", cert: str = "", key: str = "") -> ClientTLS | None:
        """From a config's CA / client certificate / client key paths (None: plaintext)."""
        return cls(ca, cert, key) if (ca or cert or key) else None

    @classmethod
    def from_dict(cls, d: dict[str, str] | None) -> ClientTLS | None:
        return cls(**d) if d else None

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    def flags(self, prefix: str = "--ps-tls-") -> list[str]:
        """The flags that give a client these settings (``recserve worker``'s ``--ps-tls-*``)."""
        out = [f"{prefix}ca", self.ca] if self.ca else []
        return out + ([f"{prefix}cert", self.cert, f"{prefix}key", self.key] if self.cert else [])

    def credentials(self) -> grpc.ChannelCredentials:
        """The one place channel credentials are built."""
        import grpc

        cert_pem, key_pem = _pair(self.cert, self.key, "TLS client") if self.cert else (None, None)
        return grpc.ssl_channel_credentials(
            root_certificates=_read_pem(self.ca, "TLS CA") if self.ca else None,
            private_key=key_pem,
            certificate_chain=cert_pem,
        )

    def describe(self) -> str:
        ca = f"CA {self.ca}" if self.ca else "the system's CAs"
        return f"mTLS with {ca}, client certificate {self.cert}" if self.cert else f"TLS with {ca}"


def describe(tls: ClientTLS | None) -> str:
    """What a client speaks, for its error messages."""
    return tls.describe() if tls else "plaintext"


def channel(target: str, options: ChannelOptions = (), tls: ClientTLS | None = None) -> grpc.Channel:
    """The one way a recserve client opens a blocking gRPC channel: TLS when ``tls`` is given."""
    import grpc

    if tls is None:
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(target, tls.credentials(), options=list(options))


# ---- a local PKI (recserve up --tls, tests) --------------------------------------------------------
@dataclass(frozen=True)
class Issued:
    """A certificate and its private key, PEM."""

    cert: bytes
    key: bytes

    def write(self, directory: str | Path, stem: str) -> tuple[Path, Path]:
        """``<stem>.pem`` and ``<stem>.key`` (0600, never over an existing file) in ``directory``."""
        directory = Path(directory)
        cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}.key"
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(self.key)
        cert_path.write_bytes(self.cert)
        return cert_path, key_path


def _new_key() -> ec.EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _builder(
    subject: str, issuer: x509.Name, public_key: CertificatePublicKeyTypes, days: float
) -> x509.CertificateBuilder:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # a little clock skew
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def make_ca(name: str = "recserve local CA", days: float = 365) -> Issued:
    """A self-signed CA certificate (may sign leaf certificates only) and its key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.serialization import Encoding
    from cryptography.x509.oid import NameOID

    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    usage = dict.fromkeys(("content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
                           "encipher_only", "decipher_only"), False)  # fmt: skip
    usage.update(digital_signature=True, key_cert_sign=True, crl_sign=True)
    cert = (
        _builder(name, subject, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(**usage), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(cert.public_bytes(Encoding.PEM), _key_pem(key))


def issue_cert(
    ca: Issued, name: str, hosts: tuple[str, ...] | list[str] = (), client: bool = False, days: float = 365
) -> Issued:
    """A leaf certificate signed by ``ca``: a server certificate valid for ``hosts`` (IP addresses
    and DNS names), or with ``client`` a client certificate (mTLS) named ``name``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.serialization import Encoding, load_pem_private_key
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    # a CA's key is one that signs certificates (make_ca's: EC P-256)
    ca_key = cast("CertificateIssuerPrivateKeyTypes", load_pem_private_key(ca.key, password=None))
    key = _new_key()
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    builder = (
        _builder(name, ca_cert.subject, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if hosts:
        names: list[x509.GeneralName] = []
        for h in dict.fromkeys(hosts):
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                names.append(x509.DNSName(h))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return Issued(cert.public_bytes(Encoding.PEM), _key_pem(key))


def local_pki(
    directory: str | Path, hosts: tuple[str, ...] | list[str] = (), client_auth: bool = True
) -> tuple[ServerTLS, ClientTLS]:
    """A fresh CA, a server certificate for ``hosts`` (plus ``LOCAL_HOSTS``) and, with
    ``client_auth``, a client certificate, under ``directory`` (made 0700; emptied of an earlier
    PKI first). Returns the servers' and the clients' settings; the CA's key is not kept."""
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)
    for old in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key"):
        (directory / old).unlink(missing_ok=True)
    ca = make_ca()
    ca_path = directory / "ca.pem"
    ca_path.write_bytes(ca.cert)
    server = issue_cert(ca, "recserve server", (*hosts, *LOCAL_HOSTS))
    server_cert, server_key = server.write(directory, "server")
    client = ClientTLS(str(ca_path))
    if client_auth:
        client_cert, client_key = issue_cert(ca, "recserve client", client=True).write(directory, "client")
        client = ClientTLS(str(ca_path), str(client_cert), str(client_key))
    return ServerTLS(str(server_cert), str(server_key), str(ca_path) if client_auth else ""), client
