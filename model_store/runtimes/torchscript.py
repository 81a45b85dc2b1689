"""TorchScript: ``torch.jit.script`` of the dense network, loaded with ``torch.jit.load`` (no
recserve code needed to run it; TorchServe loads it too)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from model_store.runtimes.base import (
    DenseFn,
    DenseRuntime,
    as_array,
    check_inputs,
    quiet_deprecations,
    torch_threads,
)
from model_store.runtimes.registry import register

if TYPE_CHECKING:
    from torch import nn


def export(model: nn.Module, path: Path, pooled: NDArray[np.float32], dense: NDArray[np.float32]) -> None:
    import torch

    scripted = torch.jit.script(model)
    scripted.eval()
    torch.jit.save(scripted, str(path))


def load_module(path: Path) -> Any:
    """The scripted module itself, in eval mode on the CPU (the follower trains through it)."""
    import torch

    with quiet_deprecations():
        module = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]  # unannotated in torch
    module.eval()
    return module


def load(path: Path, num_threads: int | None) -> DenseFn:
    import torch

    module = load_module(path)
    shape = (int(module.num_slots), int(module.dim), int(module.num_dense))
    pin_threads = torch_threads(num_threads)

    def predict(pooled: NDArray[Any], dense: NDArray[Any]) -> NDArray[np.float32]:
        p, d = as_array(pooled), as_array(dense)
        check_inputs(p, d, *shape)
        pin_threads()
        with torch.inference_mode():
            logits: NDArray[np.float32] = module(torch.from_numpy(p), torch.from_numpy(d)).numpy()
        return logits

    return predict


RUNTIME = register(DenseRuntime("torchscript", "dense/model.pt", export, load))
