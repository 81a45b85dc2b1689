"""Configuration of one PS shard: its store (``StoreConfig``) and its process (``ServerConfig``).
No numba and no gRPC here: ``recserve ps --help`` stays quick."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NoReturn

import numpy as np

from model_store.layout import default_root
from serving.ps.spec import MAX_ROWS, TableSpec
from serving.rpc.auth import read_token_file

__all__ = ["MAX_ROWS", "ServerConfig", "StoreConfig", "TableSpec", "check_holds", "not_held"]


@dataclass
class StoreConfig:
    """Configuration of one PS shard's store: the table it holds a part of, and which part."""

    table: TableSpec = field(default_factory=TableSpec)
    """The table's spec (dim, dtype, capacity, eviction, limits, optimizer): written into every dump's
    meta."""
    seed: int = 0
    """Salt of the deterministic initialisation (same seed + sign = same row everywhere)."""
    schema_hash: str = ""
    """Feature-schema hash written into dumps and required of loaded dumps ('' = not checked)."""
    shard: int = 0
    """This shard's number (names the dump directory, filters re-sharded loads)."""
    num_shards: int = 1
    """Number of shards the signs are routed over by ``features.hashing.shard_of``."""

    def __post_init__(self) -> None:
        if isinstance(self.table, dict):
            self.table = TableSpec(**self.table)
        if not 0 <= self.shard < self.num_shards:
            raise ValueError(f"shard {self.shard} outside 0..{self.num_shards - 1}")

    # the table's fields, read where the store reads its config (the spec is the one place they live)
    dim = property(lambda self: self.table.dim)
    dtype = property(lambda self: self.table.dtype)
    capacity = property(lambda self: self.table.capacity)
    eviction = property(lambda self: self.table.eviction)
    evict_fraction = property(lambda self: self.table.evict_fraction)
    max_memory_gb = property(lambda self: self.table.max_memory_gb)
    ttl_s = property(lambda self: self.table.ttl_s)
    min_count = property(lambda self: self.table.min_count)
    init_scale = property(lambda self: self.table.init_scale)
    optimizer = property(lambda self: self.table.optimizer)

    def with_table(self, **changes) -> StoreConfig:
        """This config with ``changes`` to its table spec."""
        return replace(self, table=replace(self.table, **changes))

    @classmethod
    def from_dict(cls, d: dict) -> StoreConfig:
        return cls(**d)


def check_holds(config: StoreConfig, version: str, holds: list[str]) -> None:
    """The pin check of every shard store: a lookup naming ``version`` ("" = whatever the shard
    serves) is answered only from it; otherwise ``NotServing`` (UNAVAILABLE through gRPC, a 503
    at scoring) naming the shard and what it holds -- never rows of another version."""
    if version and version not in holds:
        not_held(config, version, holds)


def not_held(config: StoreConfig, version: str, holds: list[str]) -> NoReturn:
    """Refuse a lookup naming ``version``, which the shard does not hold (``check_holds``)."""
    from serving.rpc.errors import NotServing

    raise NotServing(
        f"embedding shard {config.shard} of {config.num_shards} does not hold version {version} "
        f"(it holds {', '.join(holds) or 'none'})"
    )


def as_signs(signs) -> np.ndarray:
    """A contiguous uint64 array of signs (a view where possible)."""
    a = np.asarray(signs)
    if a.dtype != np.uint64:
        if a.dtype.kind == "i" and a.size and a.min() < 0:
            raise ValueError("signs must be non-negative (uint64)")
        a = a.astype(np.uint64)
    return np.ascontiguousarray(a.reshape(-1))


@dataclass
class ServerConfig:
    """One PS shard process."""

    host: str = "127.0.0.1"
    """Interface to bind; loopback unless told otherwise."""
    port: int = 50061
    """gRPC port (0: the OS picks one; it is logged)."""
    metrics_port: int = 0
    """Prometheus /metrics HTTP port (0: off)."""
    load: str = ""
    """Dump to load before serving: a shard directory or a directory of shard-<i>-of-<n>/."""
    grace_s: float = 5.0
    """On SIGTERM/SIGINT, in-flight calls get this long to finish."""
    max_message_mb: int = 64
    """Max gRPC send/receive message size."""
    expire_every_s: float = 10.0
    """How often TTL expiry runs (only when store.ttl_s > 0)."""
    follow: str = field(default="", metadata={"metavar": "MODEL_DIR"})
    """Model directory (<model_store>/<model>) to follow: serve its CURRENT version, switch when
    CURRENT changes, apply each new delta of the served version (serving/ps/follow.py)."""
    pin: str = ""
    """With --follow: serve this version (and its deltas) instead of the one CURRENT names."""
    poll_s: float = 1.0
    """How often the follower looks for a new version or delta."""
    keep_previous_s: float = 30.0
    """With --follow: after a switch, the replaced version keeps answering the lookups that name
    it (scoring processes still on its dense model) until none has for this long."""
    admin_token_file: str = ""
    """Training shard: file holding the token that Update, UpdateLookup, Assign, Dump, Load and
    inserting lookups need (created 0600 by whoever starts the shard; `recserve train` does).
    Without it they are refused."""
    data_root: str = field(default_factory=default_root)
    """Training shard: Dump and Load paths must lie under this directory (symlinks resolved;
    relative paths are taken under it). Default: the model-store root ($RECSERVE_STORE or ./artifacts)."""
    tls_cert: str = ""
    """TLS: this server's certificate (PEM; with --tls-key). Without it the server speaks plaintext."""
    tls_key: str = ""
    """TLS: the certificate's private key (PEM, unencrypted, mode 0600)."""
    tls_client_ca: str = ""
    """mTLS: clients must present a certificate signed by this CA (PEM)."""
    store: StoreConfig = field(default_factory=StoreConfig)
    """The shard's store (its table spec, shard, num_shards, ...)."""

    def __post_init__(self) -> None:
        self.tls()  # a missing file, or a key that is not the certificate's: say so now
        if self.admin_token_file and self.follow:
            raise ValueError(
                "--admin-token-file is for a training PS: a serving PS (--follow) has no RPC that writes"
            )
        if self.admin_token_file:
            read_token_file(self.admin_token_file)  # missing, empty or readable by others: say so now
        if self.pin and not self.follow:
            raise ValueError("--pin needs --follow")
        if self.load and self.follow:
            raise ValueError("--load and --follow exclude each other (--follow serves the model's versions)")
        if self.follow and isinstance(self.store, StoreConfig):
            check_serving_config(self.store)

    def endpoint(self):
        from serving.rpc.server import Endpoint

        return Endpoint(
            self.host, self.port, self.metrics_port, self.max_message_mb, self.grace_s, self.tls()
        )

    def tls(self):
        from serving.rpc.tls import ServerTLS

        return ServerTLS.of(self.tls_cert, self.tls_key, self.tls_client_ca)


def check_serving_config(cfg: StoreConfig) -> None:
    """A serving PS maps an immutable version: the training store's policies do not apply."""
    given = [f"--{name}" for name, on in (("eviction", cfg.eviction != "none"), ("ttl-s", cfg.ttl_s > 0),
             ("min-count", cfg.min_count > 1), ("max-memory-gb", cfg.max_memory_gb > 0)) if on]  # fmt: skip
    if given:
        raise ValueError(
            f"{', '.join(given)}: not for a serving PS (--follow), which maps the version's files as "
            "they are; eviction and TTL are training policies (recserve train --eviction/--ttl-s)"
        )
