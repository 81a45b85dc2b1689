"""The sharding planner (training/plan.py) and the plan file: choices under a budget, the sample's
statistics, YAML round trips, refusals; ``recserve plan`` end to end on the Criteo split."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from features.schema import load_schema
from features.stream import ReadOptions
from serving.ps.store import OptimizerConfig, StoreConfig
from training import plan as sharding
from training.costs import Costs, round_trips_us

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "data/schemas/criteo.yaml"
TRAIN = ROOT / "data/criteo/wide_resdnn_criteo_train.tsv"
STORE = StoreConfig(dim=16, optimizer=OptimizerConfig("adagrad"))
MIB = 1 << 20


def stats(*tables: tuple[str, int, float]) -> list[sharding.TableStats]:
    return [sharding.TableStats(n, i + 1, rows, ids, rows) for i, (n, rows, ids) in enumerate(tables)]


def test_every_table_replicated_when_all_fit():
    plan = sharding.plan_tables(stats(("a", 1000, 50.0), ("b", 10**6, 100.0)), STORE, Costs(), 8.0)
    assert {n: t.strategy for n, t in plan.tables.items()} == {"a": "replicated", "b": "replicated"}
    assert all("fits" in t.reason for t in plan.tables.values())
    assert plan.summary()["rpc_bytes_per_step"] == 0


def test_a_budget_keeps_the_most_time_per_byte_in_process_when_the_step_waits_for_the_ps():
    """Without prefetch (``--staleness 0``) a step waits for all of a PS table's time. Three
    tables of 1M rows (~76 MiB each): a budget of two keeps the two with the most IDs per step;
    the third goes to the PS, saying why; the estimates add up."""
    tables = stats(("cold", 10**6, 10.0), ("hot", 10**6, 100.0), ("warm", 10**6, 60.0), ("tiny", 100, 5.0))
    per_table = sharding.plan_tables(tables, STORE, Costs(), 100.0).tables["hot"].bytes
    budget = (2 * per_table + MIB) / (1 << 30)
    plan = sharding.plan_tables(tables, STORE, Costs(), budget, prefetch=False)
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
    per_table = sharding.plan_tables(tables, STORE, costs, 100.0).tables["hot"].bytes
    short = sharding.plan_tables(tables, STORE, costs, (per_table + MIB) / (1 << 30), num_shards=2)
    assert {t.strategy for t in short.tables.values()} == {"ps"}
    assert "overlap the dense step" in short.tables["tiny"].reason
    assert short.summary()["embedding_us_per_step"] == pytest.approx(short.compared["all_ps"], abs=0.2)
    assert short.compared["all_replicated"] is None
    ample = sharding.plan_tables(tables, STORE, costs, 100.0, num_shards=2)
    assert {t.strategy for t in ample.tables.values()} == {"replicated"}
    assert "no PS round trips" in ample.tables["cold"].reason
    assert ample.compared["all_replicated"] < ample.compared["all_ps"] == short.compared["all_ps"]
    one = sharding.plan_tables(tables, STORE, costs, 100.0, num_shards=1)
    trips = round_trips_us(costs, 1)
    assert one.compared["all_ps"] == pytest.approx(ample.compared["all_ps"] - trips, abs=0.2)
    loaded = sharding.ShardingPlan.from_dict(ample.to_dict())  # the estimates travel with the plan
    assert loaded.table() == ample.table() and (loaded.num_shards, loaded.prefetch) == (2, True)


def test_a_plan_file_from_before_the_overlap_estimate_still_loads():
    """Written before plans recorded shards, prefetch and the compared estimates, and before the
    costs had rpc_exposed and local_path: it loads with one shard and the default shares."""
    old = {
        "schema": "criteo", "nodes": 1, "ranks_per_node": 1, "memory_gb": 8.0, "batch_size": 128, "dim": 16,
        "costs": {"local_us_per_id": 0.59, "rpc_us_per_id": 2.38, "rpc_us_per_call": 870.0,
                  "allgather_gbps": 1.0, "source": "defaults"},
        "tables": {"C1": {"strategy": "ps", "ids_per_step": 10.0, "us_per_step": 23.8}, "C2": "replicated"},
    }  # fmt: skip
    plan = sharding.ShardingPlan.from_dict(old)
    assert (plan.num_shards, plan.prefetch, plan.compared) == (1, True, {})
    assert plan.costs.rpc_exposed == Costs().rpc_exposed and plan.costs.local_path == Costs().local_path
    # its own costs, and today's step: one UpdateLookup round trip per shard with prefetch
    assert plan.summary()["embedding_us_per_step"] == round(23.8 + 870.0, 1)


def test_across_nodes_a_slow_link_sends_tables_to_the_ps():
    costs = Costs(allgather_gbps=0.001)  # 1 MB/s between nodes: all-gathering loses
    plan = sharding.plan_tables(stats(("a", 1000, 50.0)), STORE, costs, 8.0, nodes=4)
    assert plan.tables["a"].strategy == "ps" and "the PS is cheaper" in plan.tables["a"].reason


def test_table_stats_are_exact_when_the_sample_is_all_the_data():
    schema = load_schema(SCHEMA)
    batches = sharding.sample(TRAIN, schema, ReadOptions(numeric_dense=True), 128, 10**6)
    got = {t.name: t for t in sharding.table_stats(batches, schema, 8000)}
    signs = np.concatenate([b.signs for b in batches])
    for slot in schema.sparse:
        mine = signs[(signs >> np.uint64(48)) == slot.id]
        assert got[slot.name].rows == len(np.unique(mine)), slot.name
    assert all(0 < t.ids_per_step <= 128 for t in got.values())
    half = sharding.table_stats(batches[:32], schema, 8000)  # extrapolated from half the rows
    assert all(h.sample_distinct <= h.rows <= 2 * h.sample_distinct + 1 for h in half)


def test_a_plan_file_round_trips_and_a_wrong_one_is_refused(tmp_path):
    schema = load_schema(SCHEMA)
    plan = sharding.uniform(schema, "replicated")
    plan.tables["C3"].strategy = "ps"
    loaded = sharding.ShardingPlan.load(plan.save(tmp_path / "plan.yaml"))
    mask = loaded.local_mask(schema)
    assert mask.sum() == 25 and not mask[[s.name for s in schema.sparse].index("C3")]
    (tmp_path / "short.yaml").write_text("tables: {C1: ps}\n")
    with pytest.raises(ValueError, match="missing tables"):
        sharding.ShardingPlan.load(tmp_path / "short.yaml").check(schema)
    loaded.tables["C1"].strategy = "gpu"
    with pytest.raises(ValueError, match="unknown strategies"):
        loaded.check(schema)
    (tmp_path / "junk.yaml").write_text("- 1\n")
    with pytest.raises(ValueError, match="not a sharding plan|a mapping"):
        sharding.ShardingPlan.load(tmp_path / "junk.yaml")


@pytest.mark.parametrize(
    ("flags", "chosen"),
    [
        ([], {"ps"}),  # half a MiB holds the small tables only: with prefetch they are no cheaper in process
        (["--staleness", "0"], {"replicated", "ps"}),  # no prefetch: the small tables fit and save time
        (["--memory-gb", "1"], {"replicated"}),  # every table fits: no PS round trips at all
    ],
)
def test_recserve_plan_prints_and_writes_the_plan(tmp_path, flags, chosen):
    out = tmp_path / "plan.yaml"
    cmd = [
        sys.executable,
        "-m",
        "recserve",
        "plan",
        "--memory-gb",
        "0.0005",
        "--no-measure",
        "--out",
        str(out),
    ]
    run = subprocess.run(cmd + flags, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "C3" in run.stdout and "wrote" in run.stdout and "(vs all " in run.stdout
    plan = sharding.ShardingPlan.load(out)
    assert {t.strategy for t in plan.tables.values()} == chosen
    assert plan.replicated_bytes <= plan.memory_gb * (1 << 30)
    assert plan.num_shards == 2 and plan.prefetch == ("--staleness" not in flags)


@pytest.mark.slow
def test_the_documented_plan_lines_run_as_printed_and_the_plan_printed_is_the_plan_trained(tmp_path):
    import json
    import os
    import re

    import model_store
    from tests.helpers import doc_blocks, recserve_argv

    heading = "Sharding plans: where each table trains"  # in docs/training.md
    ((plan_line, train_line),) = doc_blocks("docs/training.md", heading)
    env = {**os.environ, "RECSERVE_STORE": str(tmp_path)}
    planned = subprocess.run(recserve_argv(plan_line), cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    assert planned.returncode == 0, planned.stderr[-2000:]
    path = Path(re.search(r"--out (\S+)", plan_line).group(1))
    plan = sharding.ShardingPlan.load(path)
    trained = subprocess.run(recserve_argv(train_line), cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=600)  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert plan.table() in trained.stderr  # the trainer logs the very table `recserve plan` printed
    assert plan.table().splitlines()[2] in planned.stdout
    ((*shown,),) = doc_blocks("docs/training.md", heading, lang="text")
    printed = [x for x in planned.stdout.splitlines() if not x.startswith("wrote ")]
    assert shown == printed  # the doc shows what the line prints today
    version = json.loads(trained.stdout.strip().splitlines()[-1])["version_dir"]
    recorded = model_store.read_manifest(version)["train"]["plan"]["tables"]
    assert {n: t["strategy"] for n, t in recorded.items()} == {n: t.strategy for n, t in plan.tables.items()}


@pytest.mark.parametrize(
    ("flags", "why"),
    [(["--num-shards", "0"], "num_shards must be >= 1"), (["--staleness", "-1"], "staleness must be >= 0")],
)
def test_recserve_plan_refuses_a_bad_setting_naming_it(flags, why):
    cmd = [sys.executable, "-m", "recserve", "plan", "--no-measure", "--out", "", *flags]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and why in run.stderr + run.stdout, (run.returncode, run.stderr[-2000:])


def test_recserve_train_refuses_a_plan_that_does_not_fit_the_schema(tmp_path):
    (tmp_path / "plan.yaml").write_text("tables: {C1: replicated, user_id: ps}\n")
    cmd = [
        sys.executable,
        "-m",
        "recserve",
        "train",
        "--plan",
        str(tmp_path / "plan.yaml"),
        "--store",
        str(tmp_path),
    ]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "bad configuration" in run.stderr and "missing tables" in run.stderr and "user_id" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_plan_made_for_other_shards_trains_as_placed_and_says_its_estimates_do_not_hold(tmp_path, caplog):
    import logging

    from training.config import TrainConfig

    schema = load_schema(SCHEMA)
    path = sharding.uniform(schema, "ps", num_shards=1).save(tmp_path / "plan.yaml")
    cfg = TrainConfig(data=str(TRAIN), plan=str(path), num_shards=2)
    with caplog.at_level(logging.WARNING, logger="recserve.train"):
        plan = sharding.for_training(cfg, schema, ReadOptions(numeric_dense=True), 8000, world=1)
    assert {t.strategy for t in plan.tables.values()} == {"ps"}
    assert "estimated for 1 PS shard(s)" in caplog.text and "this run has 2" in caplog.text
    ps = sharding.for_training(
        TrainConfig(data=str(TRAIN), sharding="ps", num_shards=2), schema, None, 8000, 1
    )
    assert ps.num_shards == 2 and ps.summary()["embedding_us_per_step"] == round_trips_us(Costs(), 2)
    sync = sharding.for_training(
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
