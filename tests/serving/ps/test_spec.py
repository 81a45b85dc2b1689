"""The one table spec (serving/ps/spec.py): every field of it and of its optimizer is a flag of
each command whose config nests it, with the nesting config's defaults; it is written whole into
a shard dump's meta and read back from it, refusing what it does not know."""

from __future__ import annotations

import dataclasses
import json

import pytest

from model_store import RecordError
from model_store.shards import read_meta
from recserve import config
from recserve.cli import build_parser
from serving.ps.config import TableShardConfig, TrainingShardConfig
from serving.ps.optim import OptimizerSpec
from serving.ps.shard import TableShard
from serving.ps.spec import TableSpec
from training.config import TrainConfig, train_table


def _flags(command: str) -> set[str]:
    sub = build_parser(only=command)._subparsers._group_actions[0].choices[command]
    return set(sub._option_string_actions)


@pytest.mark.parametrize("command", ["train", "ps", "plan"])
def test_every_field_of_the_spec_and_its_optimizer_is_a_flag(command):
    spec_fields = [
        f for cls in (TableSpec, OptimizerSpec) for f in dataclasses.fields(cls) if f.name != "optimizer"
    ]
    wanted = {"--" + f.metadata.get("flag", f.name.replace("_", "-")) for f in spec_fields}
    assert wanted <= _flags(command), wanted - _flags(command)


def test_train_flags_and_yaml_change_what_they_name_and_keep_the_trainers_defaults(tmp_path):
    args = build_parser(only="train").parse_args(
        ["train", "--optimizer", "ftrl", "--l1", "0.25", "--capacity", "64"]
    )
    cfg = config.from_args(TrainConfig, args)
    assert cfg.table == train_table(capacity=64, optimizer=OptimizerSpec("ftrl", lr=0.005, l1=0.25))
    (tmp_path / "t.yaml").write_text("table: {dim: 8, optimizer: {l2: 0.5}}\n")
    cfg = config.load_yaml(TrainConfig, tmp_path / "t.yaml")
    assert cfg.table == train_table(dim=8, optimizer=OptimizerSpec(lr=0.005, l2=0.5))
    ps = config.from_args(TrainingShardConfig, build_parser(only="ps").parse_args(["ps", "--l1", "0.5"]))
    assert ps.store.table == TableSpec(optimizer=OptimizerSpec(l1=0.5))  # the PS's own defaults


def test_a_store_writes_its_spec_into_every_dump_and_it_reads_back_the_same(tmp_path):
    table = TableSpec(dim=4, dtype="float16", capacity=100, eviction="lru", ttl_s=60.0, min_count=2,
                      optimizer=OptimizerSpec("adam", lr=0.02, beta1=0.8, eps=1e-6))  # fmt: skip
    store = TableShard(TableShardConfig(table, seed=3))
    full, delta = store.dump(tmp_path / "full"), store.dump_delta(tmp_path / "delta")
    for path in (full, delta):
        meta = read_meta(path)
        assert TableSpec.from_meta(meta) == table and meta.seed == 3
        assert meta.state == list(table.optimizer.state_names)


def test_a_spec_of_unknown_fields_or_values_is_refused_by_name(tmp_path):
    raw = TableSpec().to_json()
    assert TableSpec.from_json(json.loads(json.dumps(raw))) == TableSpec()
    with pytest.raises(RecordError, match=r"x/meta.json: unknown table spec field\(s\) \['colour'\]"):
        TableSpec.from_json(raw | {"colour": "red"}, "x/meta.json")
    with pytest.raises(RecordError, match=r"unknown table spec field\(s\) \['optimizer.momentum'\]"):
        TableSpec.from_json(raw | {"optimizer": {"name": "sgd", "momentum": 0.9}})
    with pytest.raises(RecordError, match="unknown optimizer 'lamb'"):
        TableSpec.from_json(raw | {"optimizer": {"name": "lamb"}})
    with pytest.raises(RecordError, match="unknown eviction policy 'fifo'"):
        TableSpec.from_json(raw | {"eviction": "fifo"})
