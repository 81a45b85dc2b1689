"""The sparse-optimizer registry (serving/ps/optim.py): one list of names that the PS update, its
state matrices, dumps, the CLI choices and the in-process baseline all consult, and that refuses a
name it does not hold, at configuration time, naming the ones it knows."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from recserve.cli import build_parser, main
from serving.ps import OptimizerSpec, TableShard, TableShardConfig, optim
from serving.ps.spec import TableSpec
from training.config import TrainConfig, train_table
from training.inprocess import sparse_optimizer

KNOWN = f"known optimizers: {', '.join(optim.OPTIMIZERS)}"
NAMES = sorted(optim.OPTIMIZERS)


def test_an_unknown_optimizer_is_refused_naming_the_known_ones():
    for make in (
        lambda: OptimizerSpec(name="lamb"),
        lambda: TableShardConfig.from_dict({"table": {"dim": 4, "optimizer": {"name": "lamb"}}}),
        lambda: TrainConfig(table=TableSpec(optimizer={"name": "lamb"})),
        lambda: sparse_optimizer(SimpleNamespace(name="lamb"), [torch.zeros(2, requires_grad=True)]),
    ):
        with pytest.raises(ValueError, match=f"unknown optimizer 'lamb'; {KNOWN}$"):
            make()
    cfg = OptimizerSpec("ftrl")
    cfg.name = "lamb"  # renamed after validation: the update refuses too, it never falls back
    with pytest.raises(ValueError, match="unknown optimizer 'lamb'"):
        optim.apply(cfg, np.zeros((1, 2), np.float32), {}, np.ones((1, 2), np.float32), 1)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["ps", "--optimizer", "lamb"], "--optimizer"),
        (["train", "--optimizer", "lamb"], "--optimizer"),
        (["plan", "--optimizer", "lamb"], "--optimizer"),
    ],
)
def test_the_cli_refuses_an_unknown_optimizer_before_starting_anything(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: invalid choice: 'lamb'" in err
    assert all(f"'{name}'" in err for name in optim.OPTIMIZERS)


def test_a_yaml_config_with_an_unknown_optimizer_is_refused(tmp_path, capsys):
    (tmp_path / "ps.yaml").write_text("store: {table: {optimizer: {name: lamb}}}\n")
    assert main(["ps", "--config", str(tmp_path / "ps.yaml")]) == 2
    assert f"unknown optimizer 'lamb'; {KNOWN}" in capsys.readouterr().err


def test_the_flag_choices_are_the_registry():
    for command, flag in (("ps", "--optimizer"), ("train", "--optimizer"), ("plan", "--optimizer")):
        sub = build_parser(only=command)._subparsers._group_actions[0].choices[command]
        assert list(sub._option_string_actions[flag].choices) == list(optim.OPTIMIZERS)


@pytest.mark.parametrize("name", NAMES)
def test_every_optimizer_allocates_dumps_and_reloads_its_state(name, tmp_path):
    """A shard holds exactly the registered state matrices, and a dump reloaded continues the same."""

    def make() -> TableShard:
        return TableShard(
            TableShardConfig(table=TableSpec(dim=4, capacity=32, optimizer=OptimizerSpec(name, lr=0.05)))
        )

    spec = optim.get(name)
    rng = np.random.default_rng(0)
    signs = np.arange(1, 9, dtype=np.uint64)
    grads = [rng.standard_normal((8, 4)).astype(np.float32) for _ in range(3)]
    a = make()
    a.lookup(signs, insert=True)
    for g in grads[:2]:
        assert a.apply_gradients(signs, g) == len(signs)
    part = a.dump(tmp_path / "dump")
    assert sorted(p.name for p in part.glob("state.*")) == sorted(f"state.{name}.npy" for name in spec.state)
    b = make()
    b.load(tmp_path / "dump")
    for s in (a, b):
        s.apply_gradients(signs, grads[2])
    np.testing.assert_array_equal(a.lookup(signs)[0], b.lookup(signs)[0])
    assert not np.array_equal(a.lookup(signs)[0], make().lookup(signs, insert=True)[0])  # it trained


@pytest.mark.parametrize("name", NAMES)
def test_the_in_process_baseline_uses_the_torch_counterpart_or_refuses_at_config_time(name):
    spec = optim.get(name)
    if spec.torch is None:
        with pytest.raises(ValueError, match=f"torch has no sparse '{name}' optimizer"):
            TrainConfig(embeddings="inprocess", table=train_table(optimizer=OptimizerSpec(name)))
        return
    TrainConfig(embeddings="inprocess", table=train_table(optimizer=OptimizerSpec(name)))
    bag = torch.nn.EmbeddingBag(10, 4, mode="sum", sparse=True)
    before = bag.weight.detach().clone()
    hyper = OptimizerSpec(name, lr=0.1, eps=1e-3, beta1=0.8, beta2=0.9, initial_accumulator_value=0.5)
    opt = sparse_optimizer(hyper, bag.parameters())
    assert type(opt) is getattr(torch.optim, spec.torch)
    given = {"lr": 0.1, "eps": 1e-3, "betas": (0.8, 0.9), "initial_accumulator_value": 0.5}
    taken = {k: v for k, v in opt.defaults.items() if k in given}  # every hyper-parameter torch has
    assert taken == {k: given[k] for k in taken} and "lr" in taken and (name == "sgd" or len(taken) > 1)
    bag(torch.tensor([1, 2]), torch.tensor([0, 1])).sum().backward()
    opt.step()
    changed = (bag.weight.detach() != before).any(dim=1)
    assert changed.tolist() == [i in (1, 2) for i in range(10)]
