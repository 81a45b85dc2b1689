"""Dense model zoo: LR, FM, DeepFM and DLRM over pooled embeddings plus dense features.

Every model has the same contract, so the trainer, the exporters and serving never branch on the
kind:

    forward(pooled: (B, S, D) float32, dense: (B, F) float32) -> logits: (B,) float32

`pooled` holds one pooled embedding per (row, slot), as the embedding worker returns it; `dense`
holds the already-transformed dense features (F may be 0, the tensor is then (B, 0)). Logits are
raw: apply a sigmoid outside, train with BCEWithLogits.

All four are scriptable with `torch.jit.script` and exportable to ONNX. Optional parts (a dense
projection or bottom MLP when F == 0) are `None` submodules guarded by `is not None`, which
TorchScript resolves at compile time, so no dead branch is compiled or traced.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from training.config import ARCHS


@dataclass(kw_only=True)
class ModelConfig:
    """Shape and architecture of the dense network."""

    kind: str = "dlrm"
    """Which model: one of "lr", "fm", "deepfm", "dlrm"."""
    num_slots: int
    """S: number of categorical slots, i.e. pooled embeddings per row."""
    dim: int = 16
    """D: embedding dimension, the same for every slot."""
    num_dense: int
    """F: number of dense features per row (0 allowed)."""
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 16])
    """DLRM bottom MLP widths over the dense features; the last must equal `dim`."""
    top_mlp: list[int] = field(default_factory=lambda: [64, 32])
    """Hidden widths of the DLRM top MLP and the DeepFM deep MLP (a final layer to 1 is added)."""
    dropout: float = 0.0
    """Dropout after each hidden ReLU of the top/deep MLP (0 disables it; off in eval mode)."""
    dense_mean: list[float] | None = None
    """Fitted per-feature mean of the transformed dense inputs (F values), subtracted first by the
    network; None (with dense_std None): no fitted standardisation."""
    dense_std: list[float] | None = None
    """Fitted per-feature std (F values, each finite and > 0) the network divides by."""

    def __post_init__(self) -> None:
        if self.kind not in ARCHS:
            raise ValueError(f"unknown model kind {self.kind!r}; expected one of {ARCHS}")
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.dim < 1:
            raise ValueError(f"dim must be >= 1, got {self.dim}")
        if self.num_dense < 0:
            raise ValueError(f"num_dense must be >= 0, got {self.num_dense}")
        self.bottom_mlp = [int(w) for w in self.bottom_mlp]
        self.top_mlp = [int(w) for w in self.top_mlp]
        if any(w < 1 for w in self.bottom_mlp + self.top_mlp):
            raise ValueError(f"MLP widths must be >= 1: bottom={self.bottom_mlp} top={self.top_mlp}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.kind == "dlrm" and self.num_dense > 0:
            if not self.bottom_mlp or self.bottom_mlp[-1] != self.dim:
                raise ValueError(
                    f"DLRM bottom_mlp must end with dim={self.dim} so its output can interact "
                    f"with the embeddings; got {self.bottom_mlp}"
                )
        if self.kind == "dlrm" and self.num_dense == 0 and self.num_slots < 2:
            raise ValueError("DLRM needs at least two fields to interact: num_slots >= 2 when num_dense == 0")
        self._check_stats()

    def _check_stats(self) -> None:
        if (self.dense_mean is None) != (self.dense_std is None):
            raise ValueError("dense_mean and dense_std: give both or neither")
        if self.dense_mean is None or self.dense_std is None:
            return
        self.dense_mean = [float(x) for x in self.dense_mean]
        self.dense_std = [float(x) for x in self.dense_std]
        for name, values in (("dense_mean", self.dense_mean), ("dense_std", self.dense_std)):
            if len(values) != self.num_dense:
                raise ValueError(f"{name} has {len(values)} values, expected num_dense={self.num_dense}")
            bad = [i for i, x in enumerate(values) if not math.isfinite(x)]
            if bad:
                raise ValueError(f"{name} must be finite: feature {bad[0]} is {values[bad[0]]}")
        bad = [i for i, x in enumerate(self.dense_std) if not x > 0]
        if bad:
            raise ValueError(f"dense_std must be > 0: feature {bad[0]} is {self.dense_std[bad[0]]}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a plain mapping (e.g. loaded YAML); unknown keys are an error, not ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ModelConfig keys {unknown}; known: {sorted(known)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def mlp(in_dim: int, widths: list[int], dropout: float = 0.0, out_dim: int | None = None) -> nn.Sequential:
    """Linear+ReLU(+Dropout) per width, then an optional plain Linear to `out_dim` (the logit)."""
    layers: list[nn.Module] = []
    for w in widths:
        layers += [nn.Linear(in_dim, w), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        in_dim = w
    if out_dim is not None:
        layers.append(nn.Linear(in_dim, out_dim))
    return nn.Sequential(*layers)


class _Base(nn.Module):
    """Records the input shapes (so exporters and loaders can check inputs without the config) and
    holds the fitted dense statistics: `forward` standardises `dense`, then `logits` (the model
    proper, written by each subclass) scores. A model used inside another (DeepFM's FM) is called
    through `logits`, so the dense features are standardised once."""

    if TYPE_CHECKING:  # buffers (register_buffer); not class annotations, which TorchScript reads
        dense_mean: Tensor
        dense_std: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_slots = cfg.num_slots
        self.dim = cfg.dim
        self.num_dense = cfg.num_dense
        mean = cfg.dense_mean if cfg.dense_mean is not None else [0.0] * cfg.num_dense
        std = cfg.dense_std if cfg.dense_std is not None else [1.0] * cfg.num_dense
        self.register_buffer("dense_mean", torch.tensor(mean, dtype=torch.float32).reshape(cfg.num_dense))
        self.register_buffer("dense_std", torch.tensor(std, dtype=torch.float32).reshape(cfg.num_dense))

    def standardise(self, dense: Tensor) -> Tensor:
        """(dense - mean) / std with the fitted statistics (identity without them)."""
        return (dense - self.dense_mean) / self.dense_std

    def forward(self, pooled: Tensor, dense: Tensor) -> Tensor:
        if self.num_dense > 0:
            dense = self.standardise(dense)
        return self.logits(pooled, dense)

    def logits(self, pooled: Tensor, dense: Tensor) -> Tensor:
        raise NotImplementedError


def _wide_input(pooled: Tensor, dense: Tensor, num_dense: int) -> Tensor:
    flat = pooled.flatten(1)
    if num_dense > 0:
        return torch.cat([flat, dense], dim=1)
    return flat


class LR(_Base):
    """Logistic regression (wide model) over concat(flatten(pooled), dense)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.linear = nn.Linear(cfg.num_slots * cfg.dim + cfg.num_dense, 1)

    def logits(self, pooled: Tensor, dense: Tensor) -> Tensor:
        return self.linear(_wide_input(pooled, dense, self.num_dense)).squeeze(-1)


class FM(_Base):
    """Factorisation machine: first-order linear term + pairwise term over the field vectors.

    Fields are the S slot vectors plus, when F > 0, one extra field: a bias-free projection of the
    dense features to D. The pairwise term is 0.5 * ((sum_f v_f)^2 - sum_f v_f^2) summed over D,
    i.e. the sum of <v_i, v_j> over all field pairs i < j in O(n * D).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.linear = nn.Linear(cfg.num_slots * cfg.dim + cfg.num_dense, 1)
        self.dense_proj: nn.Linear | None = (
            nn.Linear(cfg.num_dense, cfg.dim, bias=False) if cfg.num_dense > 0 else None
        )

    def fields(self, pooled: Tensor, dense: Tensor) -> Tensor:
        """(B, n, D) field vectors: the slots, then the projected dense features if any."""
        proj = self.dense_proj
        if proj is not None:
            return torch.cat([pooled, proj(dense).unsqueeze(1)], dim=1)
        return pooled

    def logits(self, pooled: Tensor, dense: Tensor) -> Tensor:
        v = self.fields(pooled, dense)
        pairwise = 0.5 * (v.sum(dim=1).pow(2) - v.pow(2).sum(dim=1)).sum(dim=1)
        first = self.linear(_wide_input(pooled, dense, self.num_dense)).squeeze(-1)
        return first + pairwise


class DeepFM(_Base):
    """FM plus a deep MLP over concat(flatten(pooled), dense); the two logits are added."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.fm = FM(dataclasses.replace(cfg, dense_mean=None, dense_std=None))  # standardised here
        self.deep = mlp(cfg.num_slots * cfg.dim + cfg.num_dense, cfg.top_mlp, cfg.dropout, out_dim=1)

    def logits(self, pooled: Tensor, dense: Tensor) -> Tensor:
        deep = self.deep(_wide_input(pooled, dense, self.num_dense)).squeeze(-1)
        return self.fm.logits(pooled, dense) + deep


class DLRM(_Base):
    """DLRM with the "dot" interaction (facebookresearch/dlrm, arch-interaction-op=dot).

    bottom MLP(dense) -> x in R^D; fields T = [x, slot_1, ..., slot_S]; Z = T T^T; the strictly
    upper triangle of Z (each pair once, no self-dots) is concatenated with x and fed to the top
    MLP -> 1 logit. The pair indices are fixed at init (flat row-major indices into Z, a buffer),
    so the runtime graph is bmm + one gather, with no Python loop. With F == 0 there is no bottom
    MLP: the fields are the slots alone and the top MLP sees only the interactions.
    """

    if TYPE_CHECKING:  # a buffer (register_buffer); not a class annotation, which TorchScript reads
        pair_index: Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.bottom: nn.Sequential | None = (
            # no dropout here: the bottom output is a field of the dot interaction, not a hidden layer
            mlp(cfg.num_dense, cfg.bottom_mlp) if cfg.num_dense > 0 else None
        )
        n = cfg.num_slots + (1 if cfg.num_dense > 0 else 0)
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("pair_index", rows * n + cols, persistent=False)
        top_in = n * (n - 1) // 2 + (cfg.dim if cfg.num_dense > 0 else 0)
        self.top = mlp(top_in, cfg.top_mlp, cfg.dropout, out_dim=1)

    def interact(self, fields: Tensor) -> Tensor:
        """(B, n, D) -> (B, n(n-1)/2) dots <f_i, f_j> for i < j, in row-major order."""
        z = torch.bmm(fields, fields.transpose(1, 2))
        return z.flatten(1).index_select(1, self.pair_index)

    def logits(self, pooled: Tensor, dense: Tensor) -> Tensor:
        bottom = self.bottom
        if bottom is not None:
            x = bottom(dense)
            inter = self.interact(torch.cat([x.unsqueeze(1), pooled], dim=1))
            top_in = torch.cat([x, inter], dim=1)
        else:
            top_in = self.interact(pooled)
        return self.top(top_in).squeeze(-1)


_MODELS: dict[str, type[_Base]] = {"lr": LR, "fm": FM, "deepfm": DeepFM, "dlrm": DLRM}


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model named by `cfg.kind`, with PyTorch's default init (deterministic under manual_seed)."""
    return _MODELS[cfg.kind](cfg)
