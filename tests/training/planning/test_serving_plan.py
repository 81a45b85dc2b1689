"""The serving half of a plan (training/planning/serving_plan.py): the row type per table under a serving
memory budget, its bytes by the served-row formula, the version's type, the plan file, and
``recserve plan --serving-budget-gb`` as docs/serving.md prints it."""

from __future__ import annotations

import pytest

from model_store.quant import served_bytes_per_row
from tests.training.planning.helpers import STORE, stats
from training.planning import plan as sharding
from training.planning import planner, serving_plan
from training.planning.costs import Costs

GIB = 1 << 30
ROWS = {"big": 10**6, "mid": 4 * 10**5, "small": 10**4}


def _plan() -> sharding.ShardingPlan:
    tables = stats(*((n, r, 10.0) for n, r in ROWS.items()))
    return planner.plan_tables(tables, STORE, Costs(), 1.0)


def _cost(dtypes: dict[str, str]) -> int:
    return sum(ROWS[n] * served_bytes_per_row(16, d) for n, d in dtypes.items())


@pytest.mark.parametrize(
    "want",
    [
        {"big": "float32", "mid": "float32", "small": "float32"},
        {"big": "float16", "mid": "float32", "small": "float32"},
        {"big": "float16", "mid": "float16", "small": "float32"},
        {"big": "int8", "mid": "float16", "small": "float16"},
        {"big": "int8", "mid": "int8", "small": "float16"},
        {"big": "int8", "mid": "int8", "small": "int8"},
    ],
)
def test_the_most_precise_types_that_fit_the_largest_tables_narrowed_first(want):
    """A budget of exactly what ``want`` costs gives ``want``: float16 everywhere before any int8,
    the largest table first each time; every table's bytes are its rows x the served row."""
    plan = serving_plan.choose(_plan(), _cost(want) / GIB)
    assert {n: t.serving_dtype for n, t in plan.tables.items()} == want
    assert all(
        t.serving_bytes == ROWS[n] * served_bytes_per_row(16, t.serving_dtype) for n, t in plan.tables.items()
    )
    assert plan.serving_dtype == next(d for d in ("int8", "float16", "float32") if d in want.values())
    assert serving_plan.table(plan).splitlines()[2].split()[:2] == ["big", want["big"]]


def test_a_budget_that_int8_exceeds_is_refused_saying_what_it_needs():
    need = _cost(dict.fromkeys(ROWS, "int8"))
    with pytest.raises(ValueError, match="even in int8"):
        serving_plan.choose(_plan(), (need - 1) / GIB)
    with pytest.raises(ValueError, match="> 0"):
        serving_plan.choose(_plan(), 0)


def test_the_plan_file_keeps_the_serving_choice_and_refuses_an_unknown_type(tmp_path):
    plan = serving_plan.choose(_plan(), _cost({"big": "int8", "mid": "float16", "small": "float16"}) / GIB)
    loaded = sharding.ShardingPlan.load(plan.save(tmp_path / "plan.yaml"))
    assert loaded.serving_dtype == "int8" and loaded.serving_budget_gb == plan.serving_budget_gb
    assert {n: (t.serving_dtype, t.serving_bytes) for n, t in loaded.tables.items()} == {
        n: (t.serving_dtype, t.serving_bytes) for n, t in plan.tables.items()
    }
    assert sharding.ShardingPlan.from_dict({"tables": {"a": "ps"}}).serving_dtype == ""  # none planned
    bad = sharding.ShardingPlan.from_dict({"tables": {"a": {"strategy": "ps", "serving_dtype": "int4"}}})
    with pytest.raises(ValueError, match="unknown serving dtypes"):
        bad.check(type("S", (), {"sparse": [type("F", (), {"name": "a"})()], "name": "s"})())


@pytest.mark.slow
def test_the_documented_plan_and_train_lines_run_as_printed(tmp_path):
    """The plan line prints the serving choice the doc shows; the train line exports the version
    in the plan's type (int8 here), gated on its score error as any int8 export."""
    import json
    import os
    import re
    import subprocess

    import model_store as ms
    from model_store import shards
    from tests.helpers import ROOT, doc_blocks, recserve_argv

    heading = "Serving dtypes under a memory budget"  # in docs/serving.md
    ((plan_line, train_line),) = doc_blocks("docs/serving.md", heading)
    ((shown,),) = doc_blocks("docs/serving.md", heading, lang="text")
    env = {**os.environ, "RECSERVE_STORE": str(tmp_path)}
    planned = subprocess.run(recserve_argv(plan_line), cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    assert planned.returncode == 0, planned.stderr[-2000:]
    assert shown in planned.stdout.splitlines()
    plan = sharding.ShardingPlan.load(re.search(r"--out (\S+)", plan_line).group(1))
    assert plan.serving_dtype == "int8" and serving_plan.table(plan) in planned.stdout
    trained = subprocess.run(recserve_argv(train_line), cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=600)  # fmt: skip
    assert trained.returncode == 0, trained.stderr[-3000:]
    vdir = json.loads(trained.stdout.strip().splitlines()[-1])["version_dir"]
    assert {shards.read_meta(d).row_dtype for d in shards.shard_dirs(f"{vdir}/embeddings")} == {"int8"}
    quantized = ms.read_manifest(vdir).quantized
    assert quantized is not None and quantized.dtype == "int8"
