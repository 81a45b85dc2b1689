"""Configuration of one PS shard: its table shard (``TableShardConfig``; the YAML key stays
``store``), and the process of each of its two roles, nesting where it listens (``serving.rpc.config.ServerConfig``): a training shard
(``TrainingShardConfig``, ``recserve ps``) and a serving shard (``ServingShardConfig``,
``recserve ps-serve``). Each role has only its own settings, so no setting of one can be given to
the other. No numba and no gRPC here: ``recserve ps --help`` stays quick."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, NoReturn

import numpy as np

from model_store.layout import default_root
from serving.ps.spec import DTYPES, MAX_ROWS, TableSpec
from serving.rpc.auth import read_token_file
from serving.rpc.config import ServerConfig

if TYPE_CHECKING:
    from model_store.meta import ShardMeta

__all__ = [
    "MAX_ROWS",
    "ServingShardConfig",
    "TableShardConfig",
    "TableSpec",
    "TrainingShardConfig",
    "check_holds",
    "not_held",
]


@dataclass
class TableShardConfig:
    """One PS shard of a table: the table it holds a part of, and which part."""

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

    def with_table(self, **changes) -> TableShardConfig:
        """This config with ``changes`` to its table spec."""
        return replace(self, table=replace(self.table, **changes))

    @classmethod
    def from_dict(cls, d: dict) -> TableShardConfig:
        return cls(**d)


def check_holds(config: TableShardConfig, version: str, holds: list[str]) -> None:
    """The pin check of every shard store: a lookup naming ``version`` ("" = whatever the shard
    serves) is answered only from it; otherwise ``NotServing`` (UNAVAILABLE through gRPC, a 503
    at scoring) naming the shard and what it holds -- never rows of another version."""
    if version and version not in holds:
        not_held(config, version, holds)


def is_next_delta(meta: ShardMeta, version: str, delta_seq: int) -> bool:
    """Whether a delta (its ``ShardMeta``) is new to a shard serving ``version`` up to
    ``delta_seq``: False when applied already; a ``StoreError`` when it belongs to another version
    or does not follow the last one applied (a gap). Every shard store's one rule."""
    from model_store.errors import StoreError

    seq, base = meta.delta_seq, meta.base_version
    if base and version and base != version:
        raise StoreError(f"delta {seq} belongs to version {base!r}, this shard serves {version!r}")
    if seq <= delta_seq:
        return False
    if seq != delta_seq + 1:
        raise StoreError(f"delta {seq} does not follow the last applied delta {delta_seq}")
    return True


def not_held(config: TableShardConfig, version: str, holds: list[str]) -> NoReturn:
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


PS_PORT = 50061
"""A shard's default gRPC port (the first of ``recserve up``'s)."""


def _ps_server() -> ServerConfig:
    return ServerConfig(port=PS_PORT, max_message_mb=64)


@dataclass
class TrainingShardConfig:
    """One training PS shard process (``recserve ps``): rows and optimizer state that the trainer
    looks up, updates, dumps and loads (those calls need the admin token)."""

    load: str = ""
    """Dump to load before serving: a shard directory or a directory of shard-<i>-of-<n>/."""
    expire_every_s: float = 10.0
    """How often TTL expiry runs (only when store.ttl_s > 0)."""
    admin_token_file: str = ""
    """File holding the token that Update, UpdateLookup, Assign, Dump, Load and inserting lookups
    need (created 0600 by whoever starts the shard; `recserve train` does). Without it they are
    refused."""
    data_root: str = field(default_factory=default_root)
    """Dump and Load paths must lie under this directory (symlinks resolved; relative paths are
    taken under it). Default: the model-store root ($RECSERVE_STORE or ./artifacts)."""
    server: ServerConfig = field(default_factory=_ps_server)
    """Where the shard listens (host, port, metrics port, TLS, ...)."""
    store: TableShardConfig = field(default_factory=TableShardConfig)
    """The shard's store (its table spec, shard, num_shards, ...)."""

    def __post_init__(self) -> None:
        if self.admin_token_file:
            read_token_file(self.admin_token_file)  # missing, empty or readable by others: say so now

    def store_config(self) -> TableShardConfig:
        return self.store


@dataclass
class ServingShardConfig:
    """One serving PS shard process (``recserve ps-serve``): maps a model's published versions
    read-only and follows the store (a new CURRENT, each new delta). It answers reads only: no
    token, no table policies (eviction and TTL are training's: ``recserve train``)."""

    model_dir: str = field(default="", metadata={"positional": True})
    """Model directory (<model_store>/<model>) to follow: serve its CURRENT version, switch when
    CURRENT changes, apply each new delta of the served version (serving/ps/follow.py)."""
    shard: int = 0
    """This shard's number: which part of each version's rows it serves."""
    num_shards: int = 1
    """Number of shards the signs are routed over by ``features.hashing.shard_of``."""
    dim: int = 16
    """Embedding dimension (a version of another dimension is refused)."""
    dtype: str = field(default="float32", metadata={"choices": DTYPES})
    """Rows served as float32, or float16 (half the memory; float32 files are converted on load)."""
    pin: str = ""
    """Serve this version (and its deltas) instead of the one CURRENT names."""
    notices: str = "inotify"
    """How the shard learns of a new delta or CURRENT at once (serving/notices/): inotify (file
    events on MODEL_DIR, one host), kafka://BROKERS/TOPIC (the model's notice topic, any host), or
    none (the poll alone)."""
    poll_s: float = 5.0
    """How often the follower looks for a new version or delta anyway (the fallback for a missed
    notice)."""
    keep_previous_s: float = 30.0
    """After a switch, the replaced version keeps answering the lookups that name it (scoring
    processes still on its dense model) until none has for this long."""
    server: ServerConfig = field(default_factory=_ps_server)
    """Where the shard listens (host, port, metrics port, TLS, ...)."""

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("a serving PS shard needs MODEL_DIR, the model directory it follows")
        self.store_config()  # shard outside 0..num_shards-1, bad dim or dtype: say so now
        from serving.notices import parse

        parse(self.notices)  # an unknown transport: say so now

    def store_config(self) -> TableShardConfig:
        """The ``TableShardConfig`` of the mapped store: the position and the served row shape."""
        table = TableSpec(dim=self.dim, dtype=self.dtype)
        return TableShardConfig(table=table, shard=self.shard, num_shards=self.num_shards)


ShardConfig = TrainingShardConfig | ServingShardConfig
"""A shard process's config: its role is its type."""
