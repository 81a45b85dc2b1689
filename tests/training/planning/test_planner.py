"""The sharding planner (training/planning/planner.py): choices under a budget and across nodes, the
sample's statistics, the plan a run trains with."""

from __future__ import annotations

import numpy as np
import pytest

from features.schema import load_schema
from features.stream import ReadOptions
from tests.training.planning.helpers import MIB, SCHEMA, STORE, TRAIN, stats
from training.planning import plan as sharding
from training.planning import planner
from training.planning.costs import Costs, round_trips_us


def test_every_table_replicated_when_all_fit():
    plan = planner.plan_tables(stats(("a", 1000, 50.0), ("b", 10**6, 100.0)), STORE, Costs(), 8.0)
    assert {n: t.strategy for n, t in plan.tables.items()} == {"a": "replicated", "b": "replicated"}
    assert all("fits" in t.reason for t in plan.tables.values())
    assert plan.summary()["rpc_bytes_per_step"] == 0


def test_a_budget_keeps_the_most_time_per_byte_in_process_when_the_step_waits_for_the_ps():
    """Without prefetch (``--staleness 0``) a step waits for all of a PS table's time. Three
    tables of 1M rows (~76 MiB each): a budget of two keeps the two with the most IDs per step;
    the third goes to the PS, saying why; the estimates add up."""
    tables = stats(("cold", 10**6, 10.0), ("hot", 10**6, 100.0), ("warm", 10**6, 60.0), ("tiny", 100, 5.0))
    per_table = planner.plan_tables(tables, STORE, Costs(), 100.0).tables["hot"].bytes
    budget = (2 * per_table + MIB) / (1 << 30)
    plan = planner.plan_tables(tables, STORE, Costs(), budget, prefetch=False)
    chosen = {n: t.strategy for n, t in plan.tables.items()}
    assert chosen == {"cold": "ps", "hot": "replicated", "warm": "replicated", "tiny": "replicated"}
    assert "over the budget" in plan.tables["cold"].reason
    s = plan.summary()
    assert s["ps_tables"] == 1 and s["rpc_bytes_per_step"] == int(2 * 10.0 * (8 + 4 * 16))
    assert plan.replicated_bytes + plan.ps_bytes == sum(t.bytes for t in plan.tables.values())
    assert s["embedding_us_per_step"] < plan.compared["all_ps"] and plan.compared["all_replicated"] is None


def test_with_prefetch_some_tables_in_process_do_not_pay_but_all_of_them_do():
    """With prefetch a step waits for a share of a PS table's per-ID time (less than the same
    IDs in process), but pays every shard's round trips while any table is on the PS: a budget
    that holds all but one table leaves every table on the PS; one that holds them all moves
    them all in process. The round trips count once per shard."""
    costs = Costs()
    assert costs.rpc_us_per_id * costs.rpc_exposed < costs.local_us_per_id * costs.local_path  # the premise
    tables = stats(("cold", 10**6, 10.0), ("hot", 10**6, 100.0), ("tiny", 100, 5.0))
    per_table = planner.plan_tables(tables, STORE, costs, 100.0).tables["hot"].bytes
    short = planner.plan_tables(tables, STORE, costs, (per_table + MIB) / (1 << 30), num_shards=2)
    assert {t.strategy for t in short.tables.values()} == {"ps"}
    assert "overlap the dense step" in short.tables["tiny"].reason
    assert short.summary()["embedding_us_per_step"] == pytest.approx(short.compared["all_ps"], abs=0.2)
    assert short.compared["all_replicated"] is None
    ample = planner.plan_tables(tables, STORE, costs, 100.0, num_shards=2)
    assert {t.strategy for t in ample.tables.values()} == {"replicated"}
    assert "no PS round trips" in ample.tables["cold"].reason
    assert ample.compared["all_replicated"] < ample.compared["all_ps"] == short.compared["all_ps"]
    one = planner.plan_tables(tables, STORE, costs, 100.0, num_shards=1)
    trips = round_trips_us(costs, 1)
    assert one.compared["all_ps"] == pytest.approx(ample.compared["all_ps"] - trips, abs=0.2)
    loaded = sharding.ShardingPlan.from_dict(ample.to_dict())  # the estimates travel with the plan
    assert loaded.table() == ample.table() and (loaded.num_shards, loaded.prefetch) == (2, True)


def test_across_nodes_a_slow_link_sends_tables_to_the_ps():
    costs = Costs(allgather_gbps=0.001)  # 1 MB/s between nodes: all-gathering loses
    plan = planner.plan_tables(stats(("a", 1000, 50.0)), STORE, costs, 8.0, nodes=4)
    assert plan.tables["a"].strategy == "ps" and "the PS is cheaper" in plan.tables["a"].reason


def test_table_stats_are_exact_when_the_sample_is_all_the_data():
    schema = load_schema(SCHEMA)
    batches = planner.sample(TRAIN, schema, ReadOptions(numeric_dense=True), 128, 10**6)
    got = {t.name: t for t in planner.table_stats(batches, schema, 8000)}
    signs = np.concatenate([b.signs for b in batches])
    for slot in schema.sparse:
        mine = signs[(signs >> np.uint64(48)) == slot.id]
        assert got[slot.name].rows == len(np.unique(mine)), slot.name
    assert all(0 < t.ids_per_step <= 128 for t in got.values())
    half = planner.table_stats(batches[:32], schema, 8000)  # extrapolated from half the rows
    assert all(h.sample_distinct <= h.rows <= 2 * h.sample_distinct + 1 for h in half)


def test_a_plan_made_for_other_shards_trains_as_placed_and_says_its_estimates_do_not_hold(tmp_path, caplog):
    import logging

    from training.config import TrainConfig

    schema = load_schema(SCHEMA)
    path = sharding.uniform(schema, "ps", num_shards=1).save(tmp_path / "plan.yaml")
    cfg = TrainConfig(data=str(TRAIN), plan=str(path), num_shards=2)
    with caplog.at_level(logging.WARNING, logger="recserve.train"):
        plan = planner.for_training(cfg, schema, ReadOptions(numeric_dense=True), 8000, world=1)
    assert {t.strategy for t in plan.tables.values()} == {"ps"}
    assert "estimated for 1 PS shard(s)" in caplog.text and "this run has 2" in caplog.text
    ps = planner.for_training(
        TrainConfig(data=str(TRAIN), sharding="ps", num_shards=2), schema, None, 8000, 1
    )
    assert ps.num_shards == 2 and ps.summary()["embedding_us_per_step"] == round_trips_us(Costs(), 2)
    sync = planner.for_training(
        TrainConfig(data=str(TRAIN), sharding="ps", num_shards=2, staleness=0), schema, None, 8000, 1
    )
    # a step's UpdateLookup per shard with prefetch; a lookup and an update without
    assert (
        sync.summary()["embedding_us_per_step"]
        == 2 * round_trips_us(Costs(), 2)
        == 4 * Costs().rpc_us_per_call
    )
    inprocess = TrainConfig(data=str(TRAIN), sharding="ps", inprocess_ps=True)
    assert inprocess.rpc_shards == 0  # stores in this process: no round trips to estimate
