"""The sharding plan: where each embedding table (one per sparse slot) lives while training.

- ``replicated``: rows inside every trainer rank (``training.replicated``), updated synchronously,
  every rank's gradients applied on every rank;
- ``ps``: rows on the PS shards, looked up through the embedding worker and updated
  asynchronously with bounded staleness (``--staleness``).

Whatever the plan, the exported version is the same: every table becomes PS shards.

The planner (``plan_tables``) chooses per table from what a sample of the training data shows
(``table_stats``: distinct IDs, extrapolated to the whole data; distinct IDs per step), the
bytes a row costs in a store (row, optimizer state, key, index: ``serving.ps.growth.store_bytes``,
the PS's own formula), the memory budget per node for replicated tables, and per-ID costs
(``Costs``: in-process lookup + update, the same over gRPC, one RPC round trip, all-gather across
nodes). ``training.costs.measure_costs`` times the first three on this machine with a real store and a real PS
process.

The estimate knows what overlaps. A replicated table's lookup and update run on the training
thread, on the step's path. With ``--staleness`` >= 1 a PS table's update goes with the lookup of
the batch after next, and its rows arrive while the dense step runs, so a step waits for only a
share of its per-ID time (``Costs.rpc_exposed``); but every PS shard costs a step a round trip
(two without prefetch: a lookup and an update) as long as any table is on the PS. So with prefetch, moving
*some* tables in process rarely pays -- the PS's per-ID work is mostly hidden -- while moving
*every* table in process removes the round trips. The planner orders the tables by time saved
per byte and estimates the step for every prefix of that order that fits the budget, all on the
PS to every table that fits, and keeps the cheapest.

    recserve plan --schema data/schemas/criteo.yaml --data train.tsv --nodes 1 --memory-gb 8
    recserve train --plan plan.yaml
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from features.schema import Schema
from training.costs import Costs, round_trips_us

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

    # ---- what the trainer reads ----------------------------------------------------------------
    def local_mask(self, schema: Schema) -> np.ndarray:
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
            f"{s['replicated_tables']} replicated ({_size(self.replicated_bytes)} per rank), "
            f"{s['ps_tables']} on the PS ({_size(self.ps_bytes)}); per node "
            f"{_size(self.replicated_bytes * self.ranks_per_node)} replicated of {self.memory_gb:g} GiB "
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
                reason=str(t.get("reason", "")),
            )  # fmt: skip
        costs = Costs(**d["costs"]) if isinstance(d.get("costs"), dict) else Costs()
        compared = d.get("compared")
        compared = compared if isinstance(compared, dict) else {}
        return cls(
            tables, int(d.get("nodes", 1)), int(d.get("ranks_per_node", 1)), float(d.get("memory_gb", 0.0)),
            costs, str(d.get("schema", "")), int(d.get("batch_size", 128)), int(d.get("dim", 16)),
            int(d.get("num_shards", 1)), bool(d.get("prefetch", True)),
            {str(k): None if v is None else float(v) for k, v in compared.items()},
        )  # fmt: skip

    @classmethod
    def load(cls, path: str | Path) -> ShardingPlan:
        try:
            return cls.from_dict(yaml.safe_load(Path(path).read_text()))
        except (OSError, yaml.YAMLError, TypeError) as e:
            raise ValueError(f"{path}: not a sharding plan: {e}") from e


def _size(nbytes: float) -> str:
    if nbytes >= GIB:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB" if nbytes >= 1 << 20 else f"{nbytes / 1024:.0f} KiB"


def uniform(schema: Schema, strategy: str, num_shards: int = 1, prefetch: bool = True) -> ShardingPlan:
    """Every table ``strategy`` (``--sharding ps`` / ``replicated``), for a job on ``num_shards``."""
    reason = f"--sharding {strategy}"
    return ShardingPlan({s.name: TableChoice(strategy, 0, 0, 0.0, 0.0, reason) for s in schema.sparse},
                        schema=schema.name, num_shards=num_shards, prefetch=prefetch)  # fmt: skip


# ---- the sample ---------------------------------------------------------------------------------
def table_stats(batches, schema: Schema, total_rows: int) -> list[TableStats]:
    """Per table, distinct IDs and distinct IDs per batch over the sampled ``batches``
    (CompactBatches), the distinct IDs extrapolated to ``total_rows`` rows: a power law fitted
    to the distinct count at half the sample and at all of it (exact when the sample is all)."""
    per_slot: list[list[np.ndarray]] = [[] for _ in schema.sparse]
    per_batch = []
    half_at, rows = None, 0
    batches = list(batches)
    sample_rows = sum(b.num_rows for b in batches)
    for b in batches:
        splits = b.sign_splits
        for s in range(len(schema.sparse)):
            per_slot[s].append(b.signs[splits[s] : splits[s + 1]])
        per_batch.append(np.asarray(b.sign_counts, np.float64))
        rows += b.num_rows
        if half_at is None and rows >= sample_rows / 2:
            half_at = (len(per_batch), rows)
    out = []
    for s, slot in enumerate(schema.sparse):
        full = len(np.unique(np.concatenate(per_slot[s]))) if per_slot[s] else 0
        n_half, r_half = half_at or (0, 0)
        half = len(np.unique(np.concatenate(per_slot[s][:n_half]))) if n_half else 0
        est = full
        if total_rows > sample_rows and half and r_half < sample_rows:
            a = min(1.0, max(0.0, math.log(full / half) / math.log(sample_rows / r_half)))
            est = int(full * (total_rows / sample_rows) ** a)
        ids = float(np.mean([c[s] for c in per_batch])) if per_batch else 0.0
        out.append(TableStats(slot.name, int(slot.id), est, ids, full))
    return out


def sample(source, schema: Schema, read, batch_size: int, rows: int) -> list:
    """The first ``rows`` rows of ``source`` as CompactBatches of ``batch_size``."""
    from training import data

    return list(data.Split(source, schema, read, rows).batches(batch_size))


def default_memory_gb() -> float:
    """Half the memory available now (the trainer, its data pipeline and the PS need the rest)."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        available = 8 * GIB
    return round(available / 2 / GIB, 1)


# ---- the planner --------------------------------------------------------------------------------
def plan_tables(
    stats: list[TableStats], store_config, costs: Costs, memory_gb: float, nodes: int = 1,
    ranks_per_node: int = 1, schema: str = "", batch_size: int = 128, num_shards: int = 1,
    prefetch: bool = True,
) -> ShardingPlan:  # fmt: skip
    """The plan with the least estimated embedding time on a step's path whose replicated tables
    fit ``memory_gb`` per node (every rank on a node holds them): tables taken in order of time
    saved per byte while they fit, every prefix of that order weighed -- all on the PS, each table
    in turn, every table that fits -- and the cheapest kept (the module docstring says why)."""
    from serving.ps.growth import store_bytes

    world = nodes * ranks_per_node
    row_bytes = 8 + 4 * store_config.dim
    budget = memory_gb * GIB / ranks_per_node
    exposed = costs.rpc_exposed if prefetch else 1.0
    trips = round_trips_us(costs, num_shards, prefetch)
    choices: dict[str, TableChoice] = {}
    rep_us: dict[str, float] = {}
    for t in stats:
        ps_us = t.ids_per_step * costs.rpc_us_per_id * exposed
        rep = t.ids_per_step * world * costs.local_us_per_id * costs.local_path
        if world > 1:
            rep += t.ids_per_step * row_bytes * (world - 1) / (costs.allgather_gbps * 1e3)
        rep_us[t.name] = round(rep, 1)
        nbytes = store_bytes(store_config, max(t.rows, 1))
        choices[t.name] = TableChoice("ps", t.rows, nbytes, round(t.ids_per_step, 2), round(ps_us, 1))
    gain = {n: c.us_per_step - rep_us[n] for n, c in choices.items()}  # us/step saved replicated
    order = sorted(choices, key=lambda n: -gain[n] / max(choices[n].bytes, 1))
    fits, used, over = [], 0, {}
    for name in order:  # the tables that fit, in that order (one over the budget is passed over)
        if used + choices[name].bytes <= budget:
            fits.append(name)
            used += choices[name].bytes
        else:
            over[name] = used + choices[name].bytes
    # estimated step time of each prefix of `fits` replicated: k = 0 is every table on the PS
    estimate = [sum(c.us_per_step for c in choices.values()) + (trips if choices else 0.0)]
    for k, name in enumerate(fits, 1):
        estimate.append(estimate[-1] - gain[name] - (trips if k == len(choices) else 0.0))
    best = min(range(len(estimate)), key=lambda k: (round(estimate[k], 1), k))  # a tie: less memory
    chosen = set(fits[:best])
    kept = sum(choices[n].bytes for n in chosen)
    for name, c in choices.items():
        g = gain[name]
        if name in chosen:
            c.strategy, c.us_per_step = "replicated", rep_us[name]
            why = f"saves {g:.1f} us/step" if g > 0 else "with every table in process no PS round trips"
            c.reason = f"{why}; fits ({_size(kept)} of {_size(budget)} per rank)"
        elif g <= 0:
            hidden = prefetch and c.ids_per_step * costs.rpc_us_per_id > rep_us[name]  # cheaper by overlap
            overlap = " (its lookups overlap the dense step)" if hidden else ""
            cheaper = "as cheap" if round(g, 1) == 0 else "cheaper"
            c.reason = (
                f"the PS is {cheaper}{overlap}: {c.us_per_step:.1f} vs {rep_us[name]:.1f} us/step replicated"
            )
        elif name not in fits:
            c.reason = f"over the budget ({_size(over[name])} per rank > {_size(budget)})"
        else:  # a tie with the plan without it, after rounding
            c.reason = f"saves only {g:.2f} us/step replicated: not worth its memory"
    compared = {
        "all_ps": round(estimate[0], 1),
        "all_replicated": round(estimate[-1], 1) if len(fits) == len(choices) else None,
    }
    return ShardingPlan(
        choices, nodes, ranks_per_node, memory_gb, costs, schema, batch_size, store_config.dim,
        num_shards, prefetch, compared,
    )  # fmt: skip


def for_training(cfg, schema: Schema, read, total_rows: int, world: int) -> ShardingPlan:
    """The plan a run trains with (``cfg``: its TrainConfig): ``--plan``'s file, every table on
    one side (``--sharding ps|replicated``), or the planner's from a sample of the training data
    (rank 0 samples and plans, every rank gets its plan). Rank 0 logs it as a table."""
    import logging

    import torch.distributed as dist

    rank = dist.get_rank() if world > 1 else 0
    if cfg.plan:  # TrainConfig checked it against the schema
        plan = ShardingPlan.load(cfg.plan)
        if rank == 0 and (plan.num_shards, plan.prefetch) != (cfg.rpc_shards, cfg.prefetches):
            logging.getLogger("recserve.train").warning(
                "the plan %s was estimated for %d PS shard(s) with prefetch %s; this run has %d with "
                "prefetch %s: its placement is used as it is, its estimates do not hold",
                cfg.plan, plan.num_shards, plan.prefetch, cfg.rpc_shards, cfg.prefetches,
            )  # fmt: skip
    elif cfg.sharding != "auto":
        plan = uniform(schema, cfg.sharding, cfg.rpc_shards, cfg.prefetches)
    else:
        box: list = [None]
        if rank == 0:
            stats = table_stats(sample(cfg.data, schema, read, cfg.batch_size, cfg.plan_sample_rows), schema,
                                total_rows)  # fmt: skip
            per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            box[0] = plan_tables(
                stats, cfg.store_config(schema.fingerprint), Costs(),
                cfg.memory_gb or default_memory_gb(), max(1, world // per_node), per_node, schema.name,
                cfg.batch_size, cfg.rpc_shards, cfg.prefetches,
            )  # fmt: skip
        if world > 1:
            dist.broadcast_object_list(box, src=0)
        plan = box[0]
    if rank == 0:
        where = cfg.plan or f"--sharding {cfg.sharding}"
        logging.getLogger("recserve.train").info("sharding plan (%s):\n%s", where, plan.table())
    return plan
