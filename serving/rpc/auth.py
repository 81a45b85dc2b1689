"""Least privilege at the gRPC boundary, written once: which RPCs a server answers, the admin
token the writing ones need, and the one directory that request paths must stay under.

``Access`` is a server's policy, checked by the ``rpc`` decorator (``serving.rpc.errors``) before
the request is even parsed, so a refused call touches nothing. An RPC is either

- open: anyone may call it (a PS's ``Lookup`` and ``Stats``, the worker's ``Forward`` and
  ``Stats``);
- guarded: it needs the admin token (a training PS's ``Update``, ``UpdateLookup``, ``Assign``,
  ``Dump``, ``Load``), and is refused outright when the server was started without a token file;
- anything else: refused with PERMISSION_DENIED naming the server's role (a serving PS answers
  ``Update``, ``UpdateLookup``, ``Assign``, ``Dump`` and ``Load`` so, whatever the caller sends).
  Refusing rather than leaving them unregistered gives the caller a reason instead of an
  UNIMPLEMENTED that reads like a version mismatch; reflection lists the proto's methods either
  way.

The token travels as gRPC metadata ``authorization: Bearer <token>`` and is compared in constant
time (``hmac.compare_digest``): no header is UNAUTHENTICATED, a wrong token PERMISSION_DENIED. It
lives in a file that the process starting the servers creates with mode 0600 (``new_token_file``)
and passes by path (``--admin-token-file``); servers and clients read it with ``read_token_file``,
which refuses a file that group or others can read.

Paths in requests (``Dump``, ``Load``) are resolved -- symlinks followed, a relative path taken
under the root -- and must lie under the server's root (``confine``); ``..`` or a symlink out is
PERMISSION_DENIED naming the path and the root. On a network the token crosses in plain text unless
the servers use TLS (``serving.rpc.tls``), so servers bind 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from serving.rpc.errors import PermissionDenied, Unauthenticated

if TYPE_CHECKING:
    from serving.rpc.errors import Context, Metadata

TOKEN_HEADER = "authorization"
"""gRPC metadata key of the admin token (lower case, as gRPC requires)."""
SCHEME = "Bearer "


def new_token_file(path: str | Path, token: str = "") -> Path:
    """Create ``path`` (mode 0600, never over an existing file) holding ``token`` (default: a fresh
    random one)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as f:
        f.write((token or secrets.token_urlsafe(32)) + "\n")
    return path


def read_secret(path: str | Path, what: str) -> bytes:
    """The bytes of a secret file (an admin token, a TLS private key); a ValueError naming ``what``
    and the file when it is missing or readable by group or others (like ssh with a private key:
    a secret others can read is no secret)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path}: {e.strerror}") from None
    if mode & 0o077:
        raise ValueError(
            f"{what} {path} has mode {stat.S_IMODE(mode):04o}: group and others must not "
            f"read it (chmod 600 {path})"
        )
    return data


def read_token_file(path: str | Path) -> str:
    """The token in ``path``; a ValueError naming the file when it is missing, empty, or readable
    by group or others (``read_secret``)."""
    token = read_secret(path, "admin token file").decode().strip()
    if not token:
        raise ValueError(f"admin token file {path} is empty")
    return token


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token`` (none when ``token`` is empty)."""
    return ((TOKEN_HEADER, SCHEME + token),) if token else ()


def check_token(metadata: Metadata | None, token: str, what: str) -> None:
    """The one token check: ``metadata`` (a call's invocation metadata) must carry ``token``.
    No token is ``Unauthenticated``, another one ``PermissionDenied``; ``what`` names the call."""
    sent = [v for k, v in (metadata or ()) if k == TOKEN_HEADER]
    if not sent:
        raise Unauthenticated(
            f"{what} needs the admin token: send metadata '{TOKEN_HEADER}: {SCHEME}<token>'"
        )
    given = sent[0].encode() if isinstance(sent[0], str) else bytes(sent[0])
    if not hmac.compare_digest(given, (SCHEME + token).encode()):
        raise PermissionDenied(f"{what}: wrong admin token")


def confine(path: str, root: Path, what: str) -> Path:
    """``path`` resolved (symlinks followed; relative paths taken under ``root``), which must lie
    under ``root`` (resolved as well): ``PermissionDenied`` naming both otherwise."""
    if not path:
        from serving.rpc.errors import BadRequest

        raise BadRequest(f"{what} path is empty")
    real_root = Path(os.path.realpath(root))
    real = Path(os.path.realpath(real_root / path))  # an absolute ``path`` replaces the root here
    if real != real_root and real_root not in real.parents:
        raise PermissionDenied(
            f"{what} path {path!r} resolves to {real}, outside the data root {real_root} "
            "(paths must stay under the root given at start, --data-root)"
        )
    return real


@dataclass(frozen=True)
class Access:
    """One server's policy: what it answers, to whom, and where its request paths may point."""

    role: str
    """What the server is, for refusals ("serving PS (recserve ps-serve)", "training PS", ...)."""
    open: frozenset[str] = frozenset()
    """RPCs anyone may call."""
    guarded: frozenset[str] = frozenset()
    """RPCs that need the admin token."""
    token: str = ""
    """The admin token ('' = guarded RPCs are refused: nothing that writes is open by default)."""
    root: Path | None = None
    """Directory request paths must stay under (None: requests name no paths)."""

    def check(self, method: str, context: Context) -> None:
        """Whether ``method`` may run for the caller of ``context`` (raises when not)."""
        if method in self.open:
            return
        if method in self.guarded:
            self.require(method, context)
            return
        raise PermissionDenied(
            f"{method} is not served by a {self.role}: it answers {', '.join(sorted(self.open))}"
        )

    def require(self, what: str, context: Context) -> None:
        """The admin token, for ``what`` (a guarded RPC, or a writing variant of an open one)."""
        if not self.token:
            raise PermissionDenied(
                f"{what} is off: this {self.role} was started without --admin-token-file "
                "(writes are never open by default)"
            )
        check_token(context.invocation_metadata(), self.token, what)

    def path(self, path: str, what: str) -> Path:
        """``confine`` ``path`` to this server's root."""
        if self.root is None:
            raise PermissionDenied(f"{what}: this {self.role} has no data root; it accepts no paths")
        return confine(path, self.root, what)
