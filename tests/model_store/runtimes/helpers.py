"""What the dense runtimes' tests share: a small model of every kind and inputs of its shape
(S slots of dimension D, F dense features)."""

from __future__ import annotations

import numpy as np
import torch

from training.models import ModelConfig, build_model

S, D, F = 5, 8, 3


def make(kind: str, num_dense: int = F, dropout: float = 0.0, seed: int = 0) -> torch.nn.Module:
    """A ``kind`` model over S slots of dimension D and ``num_dense`` dense features, seeded."""
    torch.manual_seed(seed)
    cfg = ModelConfig(kind=kind, num_slots=S, dim=D, num_dense=num_dense, bottom_mlp=[16, D], top_mlp=[16, 8],
                      dropout=dropout)  # fmt: skip
    return build_model(cfg)


def inputs(batch: int, num_dense: int = F, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(pooled (batch, S, D), dense (batch, num_dense)) of standard normals, seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, S, D, generator=g).numpy(), torch.randn(batch, num_dense, generator=g).numpy()
