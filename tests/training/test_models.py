"""Dense model zoo: shapes, F == 0, gradients, DLRM interaction, fitted statistics in every
registered runtime's export (the runtimes themselves: tests/model_store/runtimes/)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_store import runtimes
from training.config import ARCHS
from training.models import DLRM, ModelConfig, build_model

S, D, F = 5, 8, 3


def make(kind: str, num_dense: int = F, dropout: float = 0.0, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = ModelConfig(
        kind=kind,
        num_slots=S,
        dim=D,
        num_dense=num_dense,
        bottom_mlp=[16, D],
        top_mlp=[16, 8],
        dropout=dropout,
    )
    return build_model(cfg).eval()


def inputs(batch: int, num_dense: int = F, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, S, D, generator=g), torch.randn(batch, num_dense, generator=g)


@pytest.mark.parametrize("num_dense", [F, 0])
@pytest.mark.parametrize("kind", ARCHS)
def test_shapes_and_grad_to_pooled(kind: str, num_dense: int) -> None:
    model = make(kind, num_dense).train()
    for batch in (1, 7):
        pooled, dense = inputs(batch, num_dense)
        pooled.requires_grad_(True)
        logits = model(pooled, dense)
        assert logits.shape == (batch,) and logits.dtype == torch.float32
        assert torch.isfinite(logits).all()
        torch.nn.functional.binary_cross_entropy_with_logits(logits, torch.ones(batch)).backward()
        assert pooled.grad is not None and pooled.grad.shape == pooled.shape
        assert pooled.grad.abs().sum() > 0  # the worker back-propagates this into the embeddings


@pytest.mark.parametrize("kind", ARCHS)
def test_deterministic_init(kind: str) -> None:
    a, b, c = make(kind, seed=3), make(kind, seed=3), make(kind, seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


@pytest.mark.parametrize("num_dense", [F, 0])
def test_dlrm_interaction_equals_naive_pairwise_dots(num_dense: int) -> None:
    model = make("dlrm", num_dense)
    assert isinstance(model, DLRM)
    fields = torch.randn(2, S + (1 if num_dense else 0), D, dtype=torch.float32)
    n = fields.shape[1]
    naive = torch.tensor(
        [[float(fields[b, i] @ fields[b, j]) for i in range(n) for j in range(i + 1, n)] for b in range(2)]
    )
    torch.testing.assert_close(model.interact(fields), naive)

    # and the forward pass feeds [bottom(dense), slots] through exactly that interaction
    pooled, dense = inputs(2, num_dense)
    with torch.no_grad():
        if model.bottom is not None:
            x = model.bottom(dense)
            top_in = torch.cat([x, model.interact(torch.cat([x[:, None], pooled], 1))], 1)
        else:
            top_in = model.interact(pooled)
        torch.testing.assert_close(model(pooled, dense), model.top(top_in).squeeze(-1))


def test_fm_pairwise_term_equals_naive_sum() -> None:
    model = make("fm")
    pooled, dense = inputs(3)
    with torch.no_grad():
        v = model.fields(pooled, dense)
        n = v.shape[1]
        pairs = sum((v[:, i] * v[:, j]).sum(-1) for i in range(n) for j in range(i + 1, n))
        first = model.linear(torch.cat([pooled.flatten(1), dense], 1)).squeeze(-1)
        torch.testing.assert_close(model(pooled, dense), first + pairs)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="unknown model kind"):
        ModelConfig(kind="wdl", num_slots=2, num_dense=1)
    with pytest.raises(ValueError, match="must end with dim=16"):
        ModelConfig(kind="dlrm", num_slots=2, num_dense=1, bottom_mlp=[64, 32])
    with pytest.raises(ValueError, match="unknown ModelConfig keys"):
        ModelConfig.from_dict({"kind": "lr", "num_slots": 2, "num_dense": 0, "emb_dim": 4})
    cfg = ModelConfig.from_dict({"kind": "lr", "num_slots": 2, "num_dense": 0})
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_config_rejects_bad_dense_stats() -> None:
    base = dict(kind="lr", num_slots=2, num_dense=2)
    with pytest.raises(ValueError, match="give both or neither"):
        ModelConfig(**base, dense_mean=[0.0, 1.0])
    with pytest.raises(ValueError, match="dense_std has 1 values, expected num_dense=2"):
        ModelConfig(**base, dense_mean=[0.0, 1.0], dense_std=[1.0])
    with pytest.raises(ValueError, match="dense_mean has 3 values"):
        ModelConfig(**base, dense_mean=[0.0, 1.0, 2.0], dense_std=[1.0, 1.0])
    with pytest.raises(ValueError, match=r"dense_std must be > 0: feature 1 is 0.0"):
        ModelConfig(**base, dense_mean=[0.0, 1.0], dense_std=[1.0, 0.0])
    with pytest.raises(ValueError, match=r"dense_std must be > 0: feature 0 is -2.0"):
        ModelConfig(**base, dense_mean=[0.0, 1.0], dense_std=[-2.0, 1.0])
    with pytest.raises(ValueError, match=r"dense_mean must be finite: feature 0 is nan"):
        ModelConfig(**base, dense_mean=[float("nan"), 1.0], dense_std=[1.0, 1.0])
    with pytest.raises(ValueError, match=r"dense_std must be finite: feature 1 is inf"):
        ModelConfig(**base, dense_mean=[0.0, 1.0], dense_std=[1.0, float("inf")])
    cfg = ModelConfig(**base, dense_mean=[0, 1], dense_std=[2, 3])
    assert cfg.dense_mean == [0.0, 1.0] and cfg.dense_std == [2.0, 3.0]
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg  # what the manifest records, read back
    legacy = {k: v for k, v in cfg.to_dict().items() if k not in ("dense_mean", "dense_std")}
    assert ModelConfig.from_dict(legacy).dense_mean is None  # a manifest written before the stats


def _with_stats(kind: str, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module, ModelConfig]:
    """The same network with fitted statistics and without them (the weights are equal)."""
    mean, std = [0.5, -1.0, 3.0], [2.0, 0.25, 4.0]
    fitted = ModelConfig(kind=kind, num_slots=S, dim=D, num_dense=F, bottom_mlp=[16, D], top_mlp=[16, 8],
                         dense_mean=mean, dense_std=std)  # fmt: skip
    torch.manual_seed(seed)
    with_stats = build_model(fitted).eval()
    plain = make(kind, seed=seed + 1)  # other weights, then the fitted model's but for the stats
    weights = {k: v for k, v in with_stats.state_dict().items() if k not in ("dense_mean", "dense_std")}
    plain.load_state_dict(weights, strict=False)
    assert plain.dense_std.eq(1).all() and plain.dense_mean.eq(0).all()
    return with_stats, plain, fitted


@pytest.mark.filterwarnings("ignore:.*torch.jit.load. is deprecated:DeprecationWarning")
@pytest.mark.parametrize("kind", ARCHS)
def test_fitted_stats_standardise_dense_once_and_travel_in_the_exports(kind: str, tmp_path) -> None:
    model, plain, cfg = _with_stats(kind)
    pooled, dense = inputs(9)
    mean, std = torch.tensor(cfg.dense_mean), torch.tensor(cfg.dense_std)
    with torch.no_grad():
        expected = plain(pooled, (dense - mean) / std)
        torch.testing.assert_close(model(pooled, dense), expected, rtol=0, atol=1e-6)
        assert not torch.allclose(plain(pooled, dense), expected)  # the stats change the scores
    torch.testing.assert_close(model.standardise(dense), (dense - mean) / std)
    for runtime in runtimes.EXPORTS.values():  # the stats are part of the network each one runs
        path = runtime.write(model, tmp_path / runtime.file, *inputs(2))
        got = runtime.load(path, None)(pooled.numpy(), dense.numpy())
        np.testing.assert_allclose(got, expected.numpy(), rtol=0, atol=1e-5, err_msg=runtime.name)
    saved = torch.jit.load(str(tmp_path / runtimes.get("torchscript").file)).state_dict()
    torch.testing.assert_close(saved["dense_std"], std)
