"""Configuration of one PS shard's store (no numba here: ``recserve ps --help`` stays quick)."""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.ps.optim import OptimizerConfig

_DTYPES = ("float32", "float16")


@dataclass
class StoreConfig:
    """Configuration of one PS shard's store."""

    dim: int = 16
    """Embedding dimension (all slots of a shard share it)."""
    capacity: int = 1_000_000
    """Maximum rows; memory for them is allocated up front. Inserting beyond evicts."""
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
    eviction: str = "lru"
    """Which rows go when the store is full: lru (least recently touched) or lfu (least often)."""
    evict_fraction: float = 0.01
    """When full, evict at least this fraction of capacity at once (amortises the scan)."""
    ttl_s: float = 0.0
    """Rows untouched for this long are expired by ``expire()`` (0 = never)."""
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
        if self.capacity >= 2**31 - 1:
            raise ValueError("capacity must be < 2**31 - 1 per shard (int32 slots); add shards")
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose float32 or float16")
        if self.eviction not in ("lru", "lfu"):
            raise ValueError(f"unknown eviction policy {self.eviction!r}; choose lru or lfu")
        if not 0 <= self.shard < self.num_shards:
            raise ValueError(f"shard {self.shard} outside 0..{self.num_shards - 1}")
        if self.min_count < 1:
            raise ValueError("min_count must be >= 1")

    @classmethod
    def from_dict(cls, d: dict) -> StoreConfig:
        return cls(**d)
