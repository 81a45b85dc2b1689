"""The sharding plan: where each embedding table (one per sparse slot) lives while training.

- ``replicated``: rows inside every trainer rank (``training.replicated``), updated synchronously,
  every rank's gradients applied on every rank;
- ``ps``: rows on the PS shards, looked up through the embedding worker and updated
  asynchronously with bounded staleness (``--staleness``).

Whatever the plan, the exported version is the same: every table becomes PS shards.

The planner that makes a plan from a sample of the data: ``training.planning.planner``.

    recserve plan --schema data/schemas/criteo.yaml --data train.tsv --nodes 1 --memory-gb 8
    recserve train --plan plan.yaml
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from features.schema import Schema
from model_store.quant import SERVING_DTYPES, narrowing
from training.planning.costs import Costs, round_trips_us

STRATEGIES = ("replicated", "ps")
SHARDINGS = ("auto", "ps", "replicated")
"""``--sharding``: plan from the data (auto), every table on the PS, every table in process."""
GIB = 1 << 30


@dataclass
class TableStats:
    """One table as a sample of the data shows it."""

    name: str
    slot_id: int
    rows: int
    """Distinct IDs over the whole data (extrapolated from the sample; exact when it is all)."""
    ids_per_step: float
    """Mean distinct IDs per batch: the rows a step looks up and updates."""
    sample_distinct: int


@dataclass
class TableChoice:
    strategy: str
    rows: int
    bytes: int
    """Memory of the table in a store (rows, optimizer state, key, index)."""
    ids_per_step: float
    us_per_step: float
    """Estimated lookup + update time per step where it is placed."""
    reason: str = ""
    serving_dtype: str = ""
    """The row type it is served in under the plan's serving budget ('' : none planned)."""
    serving_bytes: int = 0
    """Its memory served in that type (key, values, directory: training/planning/serving_plan.py)."""


@dataclass
class ShardingPlan:
    """Per table, where it lives; plus what the planner estimated."""

    tables: dict[str, TableChoice]
    nodes: int = 1
    ranks_per_node: int = 1
    memory_gb: float = 0.0
    """Budget per node for replicated tables (every rank on the node holds them)."""
    costs: Costs = field(default_factory=Costs)
    schema: str = ""
    batch_size: int = 128
    dim: int = 16
    num_shards: int = 1
    """PS shards a step talks to (each costs it a lookup and an update round trip)."""
    prefetch: bool = True
    """PS lookups prefetched during the dense step (``--staleness`` >= 1)."""
    compared: dict[str, float | None] = field(default_factory=dict)
    """The estimated embedding time per step (us) of the plans weighed against this one:
    ``all_ps``, ``all_replicated`` (None: it does not fit the budget)."""
    serving_budget_gb: float = 0.0
    """Memory the serving hosts give one version (0: no serving dtype planned)."""

    @property
    def serving_dtype(self) -> str:
        """The row type the version is exported in: the narrowest its tables are served in (a
        shard holds one); '' when no serving budget was planned."""
        chosen = {t.serving_dtype for t in self.tables.values()} - {""}
        return next((c.name for c in reversed(narrowing()) if c.name in chosen), "")

    # ---- what the trainer reads ----------------------------------------------------------------
    def replicated_mask(self, schema: Schema) -> np.ndarray:
        """bool per sparse slot (schema order): True where the table is replicated."""
        self.check(schema)
        return np.array([self.tables[s.name].strategy == "replicated" for s in schema.sparse], bool)

    def check(self, schema: Schema) -> None:
        names = [s.name for s in schema.sparse]
        missing = [n for n in names if n not in self.tables]
        extra = [n for n in self.tables if n not in names]
        if missing or extra:
            raise ValueError(
                f"the sharding plan does not match schema {schema.name!r}: "
                + "; ".join(x for x in (f"missing tables {missing}" * bool(missing),
                                        f"unknown tables {extra}" * bool(extra)) if x)
            )  # fmt: skip
        bad = {n: t.strategy for n, t in self.tables.items() if t.strategy not in STRATEGIES}
        if bad:
            raise ValueError(f"unknown strategies {bad}; use one of {STRATEGIES}")
        served = {
            n: t.serving_dtype for n, t in self.tables.items() if t.serving_dtype not in ("", *SERVING_DTYPES)
        }
        if served:
            raise ValueError(f"unknown serving dtypes {served}; use one of {SERVING_DTYPES}")

    def replicated_rows(self, default: int) -> int:
        """Rows the replicated tables are expected to hold (none estimated: ``default``)."""
        rows = sum(t.rows for t in self.tables.values() if t.strategy == "replicated")
        return rows or default

    @property
    def rank_budget_gb(self) -> float:
        """Memory a rank's replicated tables may take (0: no budget was planned)."""
        return self.memory_gb / self.ranks_per_node if self.memory_gb else 0.0

    @property
    def replicated_bytes(self) -> int:
        return sum(t.bytes for t in self.tables.values() if t.strategy == "replicated")

    @property
    def ps_bytes(self) -> int:
        return sum(t.bytes for t in self.tables.values() if t.strategy == "ps")

    def summary(self) -> dict:
        """Per-node memory, bytes over the network and embedding time per step (estimates)."""
        rep = [t for t in self.tables.values() if t.strategy == "replicated"]
        ps = [t for t in self.tables.values() if t.strategy == "ps"]
        world = self.nodes * self.ranks_per_node
        dim_bytes = 8 + 4 * self.dim
        rpc_calls = round_trips_us(self.costs, self.num_shards, self.prefetch) if ps else 0.0
        return {
            "replicated_tables": len(rep),
            "ps_tables": len(ps),
            "node_memory_gb": round(
                (self.replicated_bytes * self.ranks_per_node + self.ps_bytes / self.nodes) / GIB, 3
            ),
            "replicated_gb_per_rank": round(self.replicated_bytes / GIB, 3),
            "ps_gb": round(self.ps_bytes / GIB, 3),
            "rpc_bytes_per_step": int(sum(2 * t.ids_per_step * dim_bytes for t in ps)),
            "allgather_bytes_per_step": int(sum(t.ids_per_step * dim_bytes for t in rep) * (world - 1)),
            "embedding_us_per_step": round(sum(t.us_per_step for t in self.tables.values()) + rpc_calls, 1),
        }

    # ---- text and YAML -------------------------------------------------------------------------
    def table(self) -> str:
        head = f"{'table':10s} {'strategy':10s} {'rows':>12s} {'MiB':>9s} {'ids/step':>9s} {'us/step':>8s}  reason"
        lines = [head, "-" * len(head)]
        for name, t in self.tables.items():
            lines.append(
                f"{name:10s} {t.strategy:10s} {t.rows:12,d} {t.bytes / (1 << 20):9.1f} "
                f"{t.ids_per_step:9.1f} {t.us_per_step:8.1f}  {t.reason}"
            )
        s = self.summary()
        lines.append(
            f"{s['replicated_tables']} replicated ({human_size(self.replicated_bytes)} per rank), "
            f"{s['ps_tables']} on the PS ({human_size(self.ps_bytes)}); per node "
            f"{human_size(self.replicated_bytes * self.ranks_per_node)} replicated of {self.memory_gb:g} GiB "
            f"budgeted, {s['node_memory_gb']} GiB with its PS shards; per step {s['rpc_bytes_per_step']:,} B over RPC, "
            f"{s['allgather_bytes_per_step']:,} B all-gathered, ~{s['embedding_us_per_step']} us of "
            f"embedding work on a step's path{self._compared()}; costs: {self.costs.source}"
        )
        return "\n".join(lines)

    def _compared(self) -> str:
        strategies = {t.strategy for t in self.tables.values()}
        names = {"all_ps": "all on the PS", "all_replicated": "all replicated"}
        this = {"all_ps": strategies == {"ps"}, "all_replicated": strategies == {"replicated"}}
        parts = [
            f"{names[k]} {'does not fit' if v is None else f'~{v} us'}"
            for k, v in self.compared.items()
            if k in names and not this[k]  # not the plan itself
        ]
        return f" (vs {', '.join(parts)})" if parts else ""

    def to_dict(self) -> dict:
        return {
            "schema": self.schema,
            "nodes": self.nodes,
            "ranks_per_node": self.ranks_per_node,
            "memory_gb": self.memory_gb,
            "batch_size": self.batch_size,
            "dim": self.dim,
            "num_shards": self.num_shards,
            "prefetch": self.prefetch,
            "compared": dict(self.compared),
            "serving_budget_gb": self.serving_budget_gb,
            "serving_dtype": self.serving_dtype,
            "costs": dataclasses.asdict(self.costs),
            "summary": self.summary(),
            "tables": {n: dataclasses.asdict(t) for n, t in self.tables.items()},
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "# recserve sharding plan (`recserve plan`): edit a table's strategy to override it\n"
        path.write_text(text + yaml.safe_dump(self.to_dict(), sort_keys=False))
        return path

    @classmethod
    def from_dict(cls, d: dict) -> ShardingPlan:
        if not isinstance(d, dict) or not isinstance(d.get("tables"), dict):
            raise ValueError("a sharding plan is a mapping with a 'tables' mapping")
        tables = {}
        for name, t in d["tables"].items():
            t = {"strategy": t} if isinstance(t, str) else dict(t)  # `C1: ps` is enough by hand
            tables[str(name)] = TableChoice(
                strategy=str(t.get("strategy", "")), rows=int(t.get("rows", 0)), bytes=int(t.get("bytes", 0)),
                ids_per_step=float(t.get("ids_per_step", 0.0)), us_per_step=float(t.get("us_per_step", 0.0)),
                reason=str(t.get("reason", "")), serving_dtype=str(t.get("serving_dtype", "")),
                serving_bytes=int(t.get("serving_bytes", 0)),
            )  # fmt: skip
        costs = Costs(**d["costs"]) if isinstance(d.get("costs"), dict) else Costs()
        compared = d.get("compared")
        compared = compared if isinstance(compared, dict) else {}
        return cls(
            tables, int(d.get("nodes", 1)), int(d.get("ranks_per_node", 1)), float(d.get("memory_gb", 0.0)),
            costs, str(d.get("schema", "")), int(d.get("batch_size", 128)), int(d.get("dim", 16)),
            int(d.get("num_shards", 1)), bool(d.get("prefetch", True)),
            {str(k): None if v is None else float(v) for k, v in compared.items()},
            float(d.get("serving_budget_gb", 0.0)),
        )  # fmt: skip

    @classmethod
    def load(cls, path: str | Path) -> ShardingPlan:
        try:
            return cls.from_dict(yaml.safe_load(Path(path).read_text()))
        except (OSError, yaml.YAMLError, TypeError) as e:
            raise ValueError(f"{path}: not a sharding plan: {e}") from e


def human_size(nbytes: float) -> str:
    if nbytes >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB" if nbytes >= 1 << 20 else f"{nbytes / 1024:.0f} KiB"


def uniform(schema: Schema, strategy: str, num_shards: int = 1, prefetch: bool = True) -> ShardingPlan:
    """Every table ``strategy`` (``--sharding ps`` / ``replicated``), for a job on ``num_shards``."""
    reason = f"--sharding {strategy}"
    return ShardingPlan({s.name: TableChoice(strategy, 0, 0, 0.0, 0.0, reason) for s in schema.sparse},
                        schema=schema.name, num_shards=num_shards, prefetch=prefetch)  # fmt: skip
