"""``recserve plan``: choose where each embedding table trains, print the plan, write it as YAML.

Samples the training data (distinct IDs per table, extrapolated to all its rows; distinct IDs per
step), sizes every table as a store holds it (row, optimizer state, key, index), times an
in-process store and a PS process on this machine (``--no-measure``: the default figures), and
keeps the placement with the least estimated embedding time on a step's path whose replicated
tables fit ``--memory-gb`` per node: the tables that save the most time per byte in process
first, weighed against all on the PS (training/planning/planner.py says what overlaps). ``recserve train
--plan plan.yaml`` trains with exactly this plan; ``recserve train`` (``--sharding auto``) plans
the same way by itself. With ``--serving-budget-gb`` it also picks the row type each table is
served in (training/planning/serving_plan.py), and ``recserve train --plan`` exports the version so.

    recserve plan --schema data/schemas/criteo.yaml --data train.tsv --nodes 2 --memory-gb 4
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from serving.ps.spec import TableSpec


@dataclass
class PlanConfig:
    """``recserve plan``."""

    schema: str = "data/schemas/criteo.yaml"
    """Feature schema YAML: one table per sparse slot."""
    data: str = "data/criteo/wide_resdnn_criteo_train.tsv"
    """Training data (any form `recserve train` reads)."""
    data_format: str = "auto"
    """Format of the data, as `recserve train --data-format`."""
    limit: int | None = None
    """Plan for the first this many rows (None: all of them, counted in one pass)."""
    nodes: int = 1
    """Nodes the job trains on."""
    ranks_per_node: int = 1
    """Trainer processes per node (each holds the replicated tables)."""
    memory_gb: float = 0.0
    """Memory per node for replicated tables (0: half of this machine's available memory)."""
    batch_size: int = 128
    """Rows per step on each rank (as `recserve train --batch-size`)."""
    table: TableSpec = field(default_factory=TableSpec)
    """The tables' spec as `recserve train` takes it (--dim, --dtype, --optimizer, ...: a row's
    bytes are its key, its values and its optimizer state)."""
    num_shards: int = 2
    """PS shards the job trains with (as `recserve train --num-shards`): while any table is on the
    PS, each costs a step a lookup and an update round trip."""
    staleness: int = 4
    """As `recserve train --staleness`: K >= 1 prefetches the next batch's PS lookup during the
    dense step (a step waits for a share of it); 0 puts every PS lookup on the step's path."""
    prefetch: bool = True
    """As `recserve train --prefetch`: with K >= 1, the next batch's PS lookup runs during this
    step's dense work (--no-prefetch: on the step's path)."""
    sample_rows: int = 100_000
    """Rows of the data to sample."""
    measure: bool = True
    """Time an in-process store and a PS process here (--no-measure: the default figures)."""
    allgather_gbps: float = 1.0
    """Bandwidth between nodes (GB/s) for the replicated tables' gradient all-gather (assumed:
    it cannot be measured from one host)."""
    serving_budget_gb: float = 0.0
    """Memory the serving hosts give one version's rows, over all of them: each table is served
    in the most precise row type (float32, float16, int8) that lets the version fit, the largest
    tables narrowed first (0: none planned; the version is served in --serving-dtype)."""
    out: str = "plan.yaml"
    """Where to write the plan ('' : only print it)."""

    def __post_init__(self) -> None:
        if min(self.nodes, self.ranks_per_node, self.batch_size, self.sample_rows, self.num_shards) < 1:
            raise ValueError("nodes, ranks_per_node, batch_size, sample_rows and num_shards must be >= 1")
        if self.staleness < 0:
            raise ValueError("staleness must be >= 0")
        if self.memory_gb < 0 or self.allgather_gbps <= 0 or self.serving_budget_gb < 0:
            raise ValueError("memory_gb and serving_budget_gb must be >= 0 and allgather_gbps > 0")


CONFIG = PlanConfig


def run(cfg: PlanConfig) -> int:
    import dataclasses

    from features.schema import load_schema
    from features.stream import ReadOptions
    from training import data
    from training.config import TrainConfig
    from training.planning import planner, serving_plan
    from training.planning.costs import Costs, measure_costs

    t0 = time.perf_counter()
    schema = load_schema(cfg.schema)
    read = ReadOptions(format=cfg.data_format, numeric_dense=True)
    train_cfg = TrainConfig(table=cfg.table, batch_size=cfg.batch_size, num_shards=cfg.num_shards,
                            staleness=cfg.staleness, prefetch=cfg.prefetch)  # fmt: skip
    store = train_cfg.store_config(schema.fingerprint)
    rows = data.Split(cfg.data, schema, read, cfg.limit).scan().rows
    if not rows:
        print(f"recserve plan: {cfg.data}: no rows")
        return 1
    batches = planner.sample(cfg.data, schema, read, cfg.batch_size, min(cfg.sample_rows, rows))
    stats = planner.table_stats(batches, schema, rows)
    costs = measure_costs(store) if cfg.measure else Costs()
    costs = dataclasses.replace(costs, allgather_gbps=cfg.allgather_gbps)
    plan = planner.plan_tables(
        stats, store, costs, cfg.memory_gb or planner.default_memory_gb(), cfg.nodes,
        cfg.ranks_per_node, schema.name, cfg.batch_size, train_cfg.rpc_shards, train_cfg.prefetches,
    )  # fmt: skip
    print(
        f"sharding plan for {schema.name!r}: {rows:,} rows, {cfg.nodes} node(s) x {cfg.ranks_per_node} rank(s)"
    )
    print(plan.table())
    if cfg.serving_budget_gb:
        try:
            serving_plan.choose(plan, cfg.serving_budget_gb)
        except ValueError as e:
            print(f"recserve plan: {e}", file=sys.stderr)
            return 2
        print(serving_plan.table(plan))
    if cfg.out:
        print(f"wrote {plan.save(cfg.out)} ({time.perf_counter() - t0:.1f} s)")
    return 0
