"""The sharding planner: a ``ShardingPlan`` (training/planning/plan.py) from a sample of the training data.

The planner (``plan_tables``) chooses per table from what a sample of the training data shows
(``table_stats``: distinct IDs, extrapolated to the whole data; distinct IDs per step), the
bytes a row costs in a store (row, optimizer state, key, index: ``serving.ps.growth.store_bytes``,
the PS's own formula), the memory budget per node for replicated tables, and per-ID costs
(``Costs``: in-process lookup + update, the same over gRPC, one RPC round trip, all-gather across
nodes). ``training.planning.costs.measure_costs`` times the first three on this machine with a real store and a real PS
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
"""

from __future__ import annotations

import math
import os

import numpy as np

from features.schema import Schema
from training.planning.costs import Costs, round_trips_us
from training.planning.plan import GIB, ShardingPlan, TableChoice, TableStats, human_size, uniform


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
            c.reason = f"{why}; fits ({human_size(kept)} of {human_size(budget)} per rank)"
        elif g <= 0:
            hidden = prefetch and c.ids_per_step * costs.rpc_us_per_id > rep_us[name]  # cheaper by overlap
            overlap = " (its lookups overlap the dense step)" if hidden else ""
            cheaper = "as cheap" if round(g, 1) == 0 else "cheaper"
            c.reason = (
                f"the PS is {cheaper}{overlap}: {c.us_per_step:.1f} vs {rep_us[name]:.1f} us/step replicated"
            )
        elif name not in fits:
            c.reason = f"over the budget ({human_size(over[name])} per rank > {human_size(budget)})"
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
