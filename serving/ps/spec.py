"""The one spec of an embedding table: ``TableSpec`` (dim, dtype, capacity, eviction, limits,
init scale, and the optimizer with every hyper-parameter: ``serving.ps.optim.OptimizerSpec``),
and the choice lists of its fields.

It is nested, not copied: in the trainer's config (``training.config.TrainConfig.table``), in each
PS shard's store config (``serving.ps.config.TableShardConfig.table``), written whole into every shard
dump's meta (``model_store.meta.ShardMeta.table``) and read back from it (``from_meta``) by the
follower and whoever loads a dump. ``recserve.config`` turns its fields into flags (``--dim``,
``--optimizer``, ``--lr``, ``--l1``, ...) for every command whose config nests it, so a
hyper-parameter added to ``OptimizerSpec`` is a flag of ``recserve train`` and ``recserve ps``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any

from model_store.errors import RecordError
from model_store.meta import ShardMeta
from model_store.quant import SERVING_DTYPES
from serving.ps.optim import OptimizerSpec

DTYPES = ("float32", "float16")
"""Row storage types (optimizer state stays float32)."""
EVICTIONS = ("none", "lru", "lfu")
"""What a full table does (``TableSpec.eviction``)."""
MAX_ROWS = 2**31 - 2
"""Rows one shard can index: row positions are int32 entries of the index (add shards beyond it)."""


@dataclass
class TableSpec:
    """One embedding table: its rows, its limits and the optimizer that trains it."""

    dim: int = 16
    """Embedding dimension."""
    dtype: str = field(default="float32", metadata={"choices": DTYPES})
    """Row storage type: float32, or float16 to halve row memory (optimizer state stays float32)."""
    serving_dtype: str = field(default="float32", metadata={"choices": SERVING_DTYPES})
    """Row type of the versions exported from it (full dumps and deltas): float32, float16 (half
    the bytes) or int8 (row-wise, an fp16 scale and bias per row: dim + 4 bytes; each element
    within (max - min) / 510 of its row's float32 value, ``model_store.quant``). Training keeps
    float32 rows and optimizer state either way; the export records both AUCs in the manifest."""
    capacity: int = 1_000_000
    """Initial rows of each shard: memory for them is allocated up front. With eviction none a full
    shard grows (about 2x) up to max_memory_gb; with lru or lfu inserts beyond it evict. A loaded
    dump with more rows gets room for all of them."""
    eviction: str = field(default="none", metadata={"choices": EVICTIONS})
    """What a full shard does: none (grow, never drop a row; past max_memory_gb fail loudly), lru
    (evict the least recently touched rows) or lfu (the least often touched). Evictions are counted
    (stats, metrics, logs)."""
    evict_fraction: float = 0.01
    """With lru/lfu: when full, evict at least this fraction of capacity at once (amortises the scan)."""
    max_memory_gb: float = 0.0
    """Memory limit of each shard's arrays in GiB (0 = no limit): growth past it is refused with an
    error naming the rows and the limit (RESOURCE_EXHAUSTED over gRPC); rows are never dropped."""
    ttl_s: float = 0.0
    """Rows untouched for this long are removed, and counted as expired (0 = never); a PS process
    checks every expire_every_s, training's in-process shards at each epoch end."""
    min_count: int = 1
    """Admission: a sign gets a row only once it has been seen this many times (count-min sketch);
    until then lookups answer the default (zero) row."""
    init_scale: float = 0.01
    """New rows are uniform(-init_scale, init_scale), drawn deterministically from the sign."""
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    """The sparse optimizer and its hyper-parameters."""

    def __post_init__(self) -> None:
        if isinstance(self.optimizer, dict):
            self.optimizer = OptimizerSpec(**self.optimizer)
        if self.dim < 1 or self.capacity < 1:
            raise ValueError(f"dim and capacity must be >= 1 (dim={self.dim}, capacity={self.capacity})")
        if self.capacity > MAX_ROWS:
            raise ValueError("capacity must be < 2**31 - 1 per shard (int32 row positions); add shards")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose {' or '.join(DTYPES)}")
        if self.serving_dtype not in SERVING_DTYPES:
            raise ValueError(
                f"unknown serving dtype {self.serving_dtype!r}; choose {', '.join(SERVING_DTYPES)}"
            )
        if self.eviction not in EVICTIONS:
            raise ValueError(f"unknown eviction policy {self.eviction!r}; choose {', '.join(EVICTIONS)}")
        if self.min_count < 1:
            raise ValueError("min_count must be >= 1")
        if self.max_memory_gb < 0 or self.ttl_s < 0:
            raise ValueError("max_memory_gb and ttl_s must be >= 0 (0: no limit, no expiry)")

    def to_json(self) -> dict[str, Any]:
        """The spec as JSON values (what a shard meta's ``table`` holds)."""
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any], where: str = "table spec") -> TableSpec:
        """The spec of ``raw`` (``to_json``'s output; fields it lacks take their defaults: a dump
        written before they were recorded). Unknown fields or values are a ``RecordError``."""
        known = {f.name for f in dataclasses.fields(cls)}
        opt_known = {f.name for f in dataclasses.fields(OptimizerSpec)}
        optimizer = raw.get("optimizer", {})
        unknown = sorted(set(raw) - known) + sorted(f"optimizer.{k}" for k in set(optimizer) - opt_known)
        if unknown:
            raise RecordError(f"{where}: unknown table spec field(s) {unknown}")
        try:
            return cls(**{**raw, "optimizer": OptimizerSpec(**optimizer)})
        except (TypeError, ValueError) as e:
            raise RecordError(f"{where}: not a valid table spec: {e}") from None

    @classmethod
    def from_meta(cls, meta: ShardMeta, where: str = "shard meta") -> TableSpec:
        """The spec a shard dump was written with."""
        return cls.from_json(meta.table, where)
