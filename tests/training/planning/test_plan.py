"""The plan file (training/planning/plan.py): YAML round trips, refusals; ``recserve plan`` end to end on the
Criteo split (the planner's choices: test_planner.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from features.schema import load_schema
from tests.helpers import ROOT
from tests.training.planning.helpers import SCHEMA
from training.planning import plan as sharding
from training.planning.costs import Costs


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


def test_a_plan_file_round_trips_and_a_wrong_one_is_refused(tmp_path):
    schema = load_schema(SCHEMA)
    plan = sharding.uniform(schema, "replicated")
    plan.tables["C3"].strategy = "ps"
    loaded = sharding.ShardingPlan.load(plan.save(tmp_path / "plan.yaml"))
    mask = loaded.replicated_mask(schema)
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
    recorded = model_store.read_manifest(version).train.plan["tables"]  # type: ignore[union-attr,index]
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
