"""Configuration of one PS shard: its store (``StoreConfig``) and its process (``ServerConfig``).
No numba and no gRPC here: ``recserve ps --help`` stays quick."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np

from model_store.layout import default_root
from serving.ps.optim import OptimizerConfig
from serving.rpc.auth import read_token_file

_DTYPES = ("float32", "float16")
EVICTIONS = ("none", "lru", "lfu")
MAX_ROWS = 2**31 - 2
"""Rows one shard can index: slots are int32 entries of the index (add shards beyond it)."""


@dataclass
class StoreConfig:
    """Configuration of one PS shard's store."""

    dim: int = 16
    """Embedding dimension (all slots of a shard share it)."""
    capacity: int = 1_000_000
    """Initial rows: memory for them is allocated up front. With eviction none a full store grows
    (about 2x) up to max_memory_gb; with lru or lfu inserts beyond it evict. A loaded dump with
    more rows gets room for all of them."""
    dtype: str = "float32"
    """Row storage type: float32, or float16 to halve row memory (state stays float32)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Sparse optimizer applied by ``apply_gradients``."""
    init_scale: float = 0.01
    """New rows are uniform(-init_scale, init_scale), drawn deterministically from the sign."""
    seed: int = 0
    """Salt of the deterministic initialisation (same seed + sign = same row everywhere)."""
    min_count: int = 1
    """Admission: a sign gets a row only once it has been seen this many times (count-min
    sketch); until then lookups answer the default (zero) row."""
    eviction: str = field(default="none", metadata={"choices": list(EVICTIONS)})
    """What a full store does: none (grow, never drop a row; past max_memory_gb fail loudly), lru
    (evict the least recently touched rows) or lfu (the least often touched). Evictions are
    counted (stats, metrics, logs)."""
    evict_fraction: float = 0.01
    """With lru/lfu: when full, evict at least this fraction of capacity at once (amortises the
    scan)."""
    max_memory_gb: float = 0.0
    """Memory limit of the store's arrays in GiB (0 = no limit): growth past it is refused with
    an error naming the rows and the limit (RESOURCE_EXHAUSTED over gRPC); rows are never dropped."""
    ttl_s: float = 0.0
    """Rows untouched for this long are removed, and counted as expired (0 = never); a PS
    process checks every expire_every_s, training's in-process shards at each epoch end."""
    schema_hash: str = ""
    """Feature-schema hash written into dumps and required of loaded dumps ('' = not checked)."""
    shard: int = 0
    """This shard's number (names the dump directory, filters re-sharded loads)."""
    num_shards: int = 1
    """Number of shards the signs are routed over by ``features.hashing.shard_of``."""

    def __post_init__(self) -> None:
        if isinstance(self.optimizer, dict):
            self.optimizer = OptimizerConfig(**self.optimizer)
        if self.dim < 1 or self.capacity < 1:
            raise ValueError(f"dim and capacity must be >= 1 (dim={self.dim}, capacity={self.capacity})")
        if self.capacity > MAX_ROWS:
            raise ValueError("capacity must be < 2**31 - 1 per shard (int32 slots); add shards")
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose float32 or float16")
        if self.eviction not in EVICTIONS:
            raise ValueError(f"unknown eviction policy {self.eviction!r}; choose none, lru or lfu")
        if not 0 <= self.shard < self.num_shards:
            raise ValueError(f"shard {self.shard} outside 0..{self.num_shards - 1}")
        if self.min_count < 1:
            raise ValueError("min_count must be >= 1")
        if self.max_memory_gb < 0 or self.ttl_s < 0:
            raise ValueError("max_memory_gb and ttl_s must be >= 0 (0: no limit, no expiry)")

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
    """The shard's store (shard, num_shards, dim, capacity, optimizer, ...)."""

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
