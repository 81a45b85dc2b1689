"""A dense runtime's type and what every runtime shares: the model contract's names, the loaded
callable's type (``DenseFn``), the input check, torch's threads per thread and quiet deprecations.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

if TYPE_CHECKING:
    import torch
    from torch import nn

OUTPUT_NAME = "logits"
INPUT_NAMES = ("pooled", "dense")

DenseFn = Callable[[NDArray[Any], NDArray[Any]], NDArray[np.float32]]
"""(pooled (B, S, D), dense (B, F)) -> logits (B,), float32."""
Export = Callable[["nn.Module", Path, NDArray[np.float32], NDArray[np.float32]], None]
Load = Callable[[Path, "int | None"], DenseFn]


@dataclass(frozen=True)
class DenseRuntime:
    """One registered dense runtime."""

    name: str
    """What ``--runtime`` and the manifest's ``dense`` map call it."""
    file: str
    """Where its export lies in a version directory (``dense/model.<ext>``); its suffix is how
    ``for_file`` knows a bare path's runtime."""
    export: Export | None
    """``export(model, path, pooled, dense)``: write ``model`` to ``path``. ``write`` calls it with
    the bare module (not a DDP wrapper) in eval mode, under ``torch.no_grad``; ``pooled``/``dense``
    are example rows for exporters that trace. None for a runtime that runs ``of``'s export."""
    load: Load
    """``load(path, num_threads)`` -> DenseFn on ``device`` of this host (``num_threads``: intra-op
    threads; None keeps the runtime's default)."""
    device: str = "cpu"
    """Where it computes: ``cpu`` or ``cuda`` (``model_store.devices``)."""
    of: str = ""
    """The runtime whose export it runs ('' = its own: it exports, and ``file`` is its file)."""
    modules: tuple[str, ...] = ()
    """Modules its export and load import on first use (``preload``)."""

    @property
    def source(self) -> str:
        """The runtime that writes the file this one loads: the manifest's ``dense`` key for it."""
        return self.of or self.name

    def write(
        self, model: nn.Module, path: str | os.PathLike[str], pooled: ArrayLike, dense: ArrayLike
    ) -> Path:
        """Export ``model`` to ``path`` in eval mode, then hand the trainer its model back as it was."""
        import torch

        if self.export is None:
            raise ValueError(f"dense runtime {self.name!r} writes nothing: it runs {self.of}'s export")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
        was_training = inner.training
        inner.eval()
        try:
            with quiet_deprecations(), torch.no_grad():
                self.export(inner, path, as_array(pooled), as_array(dense))
        finally:
            inner.train(was_training)
        return path


@contextmanager
def quiet_deprecations() -> Iterator[None]:
    """Silence torch's deprecation warnings of ``torch.jit`` and the TorchScript-based ONNX
    exporter (deprecated in torch 2.13, still working, and TorchServe still loads ``.pt``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\..*")
        warnings.filterwarnings("ignore", message=r".*legacy TorchScript-based ONNX export.*")
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.(script|load). is deprecated.*")
        warnings.filterwarnings("ignore", message=r".*feature will be removed.*")
        yield


def torch_threads(num_threads: int | None) -> Callable[[], None]:
    """A setter of torch's intra-op threads for the thread that calls it (a loaded model calls it
    before each run; None keeps each thread's count).

    torch's count is OpenMP's, which is a setting of each thread: ``torch.set_num_threads`` in the
    thread that loads a model leaves the thread that scores with it at the count it had (the
    default, one per core, if it ran torch before), and later code in that thread may set it again.
    There, two OpenMP threads on a two-core host ran every 20-row request, the second spinning
    between requests: 7.7 ms p50 and ~47% of a CPU at 50 rps, against 2.0 ms and 8% at one."""
    import torch

    def pin() -> None:
        if num_threads is not None and torch.get_num_threads() != num_threads:
            torch.set_num_threads(num_threads)

    return pin


def as_array(x: ArrayLike | torch.Tensor) -> NDArray[np.float32]:
    """float32, C-contiguous and writable (a torch tensor is copied to the host first; a read-only
    array, e.g. a binary request's dense values viewed in its body, is copied: ``torch.from_numpy``
    of one is undefined behaviour, and torch warns)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.require(x, np.float32, ["C_CONTIGUOUS", "WRITEABLE"])


def check_inputs(
    pooled: NDArray[np.float32], dense: NDArray[np.float32], slots: int, dim: int, num_dense: int
) -> None:
    """Shape errors with a message naming the problem, instead of a deep runtime error."""
    if pooled.ndim != 3 or pooled.shape[1:] != (slots, dim):
        raise ValueError(f"pooled must be (B, {slots}, {dim}), got {pooled.shape}")
    if dense.ndim != 2 or dense.shape != (pooled.shape[0], num_dense):
        raise ValueError(f"dense must be ({pooled.shape[0]}, {num_dense}), got {dense.shape}")
