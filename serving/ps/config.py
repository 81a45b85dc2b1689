"""Configuration of one PS shard's store (no numba here: ``recserve ps --help`` stays quick)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from serving.ps.optim import OptimizerConfig

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
