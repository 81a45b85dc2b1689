"""Dense runtimes: the formats a version's dense network ships in, and their registry.

A runtime is one module of this package that calls ``register(DenseRuntime(...))`` with its
name, the file it writes in a version directory, an exporter and a loader, and the device it runs
on. A runtime may run another's export on another device (``of``: ``torchscript-cuda`` and
``cuda-graphs`` run the TorchScript file on a GPU): it writes nothing, and a version ships it
wherever it ships that file. The package imports
every module in it (names starting with ``_`` excepted), so a new runtime is one file here plus
its test: export (``training.export_dense`` writes and verifies every exporting runtime, ``EXPORTS``), the
manifest's ``dense`` map, the timing that names the faster one for ``--runtime auto``, and the
``--runtime`` choices of every frontend all come from ``RUNTIMES``. ``get`` refuses a name it
does not hold.

The model contract (``training.models``): inputs ``pooled`` (B, S, D) and ``dense`` (B, F)
float32, output ``logits`` (B,), batch axis dynamic. A loaded runtime is one numpy-in/numpy-out
callable (``DenseFn``) that refuses inputs of the wrong shape with a ValueError naming the
expected one (``check_inputs``).

Heavy imports (torch, onnxruntime) stay inside a runtime's functions: importing the registry to
list the choices costs nothing.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
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


RUNTIMES: dict[str, DenseRuntime] = {}
"""Every registered runtime by name, in registration (module name) order."""
EXPORTS: dict[str, DenseRuntime] = {}
"""The runtimes that write a file of their own (``export`` not None): what a version ships."""


def register(runtime: DenseRuntime) -> DenseRuntime:
    """Add ``runtime`` to the registry (a name or a file registered twice is a ValueError; so is a
    runtime that both exports and runs another's export, or runs the export of one not registered
    before it, or in another file)."""
    if runtime.name in RUNTIMES:
        raise ValueError(f"dense runtime {runtime.name!r} registered twice")
    if (runtime.export is None) != bool(runtime.of):
        raise ValueError(
            f"dense runtime {runtime.name!r}: give either an exporter or the runtime it runs (of)"
        )
    if runtime.of:
        source = EXPORTS.get(runtime.of)
        if source is None or source.file != runtime.file:
            raise ValueError(
                f"dense runtime {runtime.name!r} runs {runtime.of!r}'s export: register that first, same file"
            )
        RUNTIMES[runtime.name] = runtime
        return runtime
    taken = {Path(r.file).suffix: r.name for r in EXPORTS.values()}
    if Path(runtime.file).suffix in taken:
        raise ValueError(
            f"dense runtime {runtime.name!r}: {runtime.file} has the suffix of {taken[Path(runtime.file).suffix]}'s"
        )
    RUNTIMES[runtime.name] = EXPORTS[runtime.name] = runtime
    return runtime


def preload() -> None:
    """Import every exporting runtime's modules now: a long-running process that exports (the
    streaming trainer's full versions) holds them from its start. Of the ~72 MB a process's first
    export adds (the DLRM of the Criteo schema), 21 MB are these modules; a second adds ~3 MB."""
    import importlib

    for runtime in EXPORTS.values():
        for module in runtime.modules:
            importlib.import_module(module)


def get(name: str) -> DenseRuntime:
    """The runtime registered as ``name``; a ValueError naming the known ones otherwise."""
    try:
        return RUNTIMES[name]
    except KeyError:
        raise ValueError(f"unknown dense runtime {name!r}; known runtimes: {', '.join(RUNTIMES)}") from None


def for_file(path: str | os.PathLike[str]) -> DenseRuntime:
    """The (CPU) runtime that writes files ending like ``path``; a ValueError naming the known
    suffixes otherwise."""
    suffix = Path(path).suffix
    for runtime in EXPORTS.values():
        if Path(runtime.file).suffix == suffix:
            return runtime
    known = ", ".join(Path(r.file).suffix for r in EXPORTS.values())
    raise ValueError(f"{path}: unknown dense model format {suffix!r}; expected one of {known}")


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
    """float32, C-contiguous (a torch tensor is copied to the host first)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(x, dtype=np.float32)


def check_inputs(
    pooled: NDArray[np.float32], dense: NDArray[np.float32], slots: int, dim: int, num_dense: int
) -> None:
    """Shape errors with a message naming the problem, instead of a deep runtime error."""
    if pooled.ndim != 3 or pooled.shape[1:] != (slots, dim):
        raise ValueError(f"pooled must be (B, {slots}, {dim}), got {pooled.shape}")
    if dense.ndim != 2 or dense.shape != (pooled.shape[0], num_dense):
        raise ValueError(f"dense must be ({pooled.shape[0]}, {num_dense}), got {dense.shape}")


def _discover() -> None:
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")


_discover()
