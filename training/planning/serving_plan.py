"""The serving half of a plan: the row type each table is served in, under a serving memory budget.

A version's rows are served from memory: ``model_store.quant.served_bytes_per_row`` bytes a row
(key, values in the serving dtype, directory). Given the memory the serving hosts give one
version (``recserve plan --serving-budget-gb``: over all of them), ``choose`` keeps every table
in float32 if that fits; else it narrows tables to float16, the largest first, until the version
fits; then, if every table in float16 is still too big, to int8, the largest first. So the fewest
tables lose precision, and none goes to int8 while float16 would do (float16 scores within
~1e-4 of float32, int8 within ~1e-3: docs/serving.md). A budget that all-int8 exceeds is refused,
saying how much it needs. The types it narrows through are the row codecs the planner may choose,
widest first (``model_store.quant.narrowing``, ``RowCodec.planned``).

A version's shards hold one row type (one ``rows.npy`` per shard), so the version is exported in
the narrowest type chosen (``ShardingPlan.serving_dtype``: what ``recserve train --plan`` writes
its version in); the per-table choice says which tables need it and what each costs.
"""

from __future__ import annotations

from model_store.quant import SERVING_DTYPES, narrowing, served_bytes_per_row
from training.planning.plan import GIB, ShardingPlan, human_size


def choose(plan: ShardingPlan, budget_gb: float) -> ShardingPlan:
    """Set each table's ``serving_dtype`` and ``serving_bytes`` in ``plan`` (and its
    ``serving_budget_gb``) for a version served in ``budget_gb``; returns the plan. ValueError when
    even int8 does not fit."""
    if budget_gb <= 0:
        raise ValueError("the serving budget must be > 0 GB")
    budget = budget_gb * GIB
    tables = plan.tables
    order = [c.name for c in narrowing() if c.planned]  # float32, float16, int8
    dtype = dict.fromkeys(tables, order[0])

    def size(name: str) -> int:
        return max(tables[name].rows, 1) * served_bytes_per_row(plan.dim, dtype[name])

    largest_first = sorted(tables, key=lambda n: -tables[n].rows)
    for narrower in order[1:]:  # float16, then int8
        for name in largest_first:
            if sum(map(size, tables)) <= budget:
                break
            dtype[name] = narrower
    need = sum(map(size, tables))
    if need > budget:
        raise ValueError(
            f"the tables need {human_size(need)} served even in {order[-1]}; the serving budget is "
            f"{human_size(budget)} (--serving-budget-gb)"
        )
    for name, t in tables.items():
        t.serving_dtype, t.serving_bytes = dtype[name], size(name)
    plan.serving_budget_gb = budget_gb
    return plan


def table(plan: ShardingPlan) -> str:
    """The serving choice as text: per table its dtype and bytes, then the version's."""
    head = f"{'table':10s} {'served as':9s} {'rows':>12s} {'bytes':>10s}"
    lines = [head, "-" * len(head)]
    for name, t in plan.tables.items():
        lines.append(f"{name:10s} {t.serving_dtype:9s} {t.rows:12,d} {human_size(t.serving_bytes):>10s}")
    total = sum(t.serving_bytes for t in plan.tables.values())
    counts = {d: sum(t.serving_dtype == d for t in plan.tables.values()) for d in SERVING_DTYPES}
    lines.append(
        f"served: {', '.join(f'{n} {d}' for d, n in counts.items() if n)}; {human_size(total)} of "
        f"{plan.serving_budget_gb:g} GiB budgeted; the version's shards hold one row type: exported in "
        f"{plan.serving_dtype}"
    )
    return "\n".join(lines)
