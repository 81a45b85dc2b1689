"""What the planner's tests share: the Criteo schema and training split, a PS table's settings,
and tables' statistics written as (name, rows, IDs per step)."""

from __future__ import annotations

from serving.ps.shard import OptimizerSpec, TableShardConfig
from serving.ps.spec import TableSpec
from tests.helpers import ROOT
from training.planning import plan as sharding

SCHEMA = ROOT / "data/schemas/criteo.yaml"
TRAIN = ROOT / "data/criteo/wide_resdnn_criteo_train.tsv"
STORE = TableShardConfig(table=TableSpec(dim=16, optimizer=OptimizerSpec("adagrad")))
MIB = 1 << 20


def stats(*tables: tuple[str, int, float]) -> list[sharding.TableStats]:
    """One ``TableStats`` per (name, rows, IDs per step), slots numbered from 1, every row distinct."""
    return [sharding.TableStats(n, i + 1, rows, ids, rows) for i, (n, rows, ids) in enumerate(tables)]
