"""Which dense runtime serves a version, and loading it: one numpy-in/numpy-out callable
whichever runtime was exported (the runtimes themselves are registered in
``model_store.runtimes``; this module only chooses among them and times them).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from model_store import runtimes
from model_store.runtimes import OUTPUT_NAME, DenseFn, as_array, quiet_deprecations

if TYPE_CHECKING:
    from model_store.manifest import VersionManifest

__all__ = [
    "AUTO", "CHOICES", "OUTPUT_NAME", "RUNTIMES", "TIMED_ROWS", "DenseFn", "as_array", "check_runtime",
    "load_dense", "quiet_deprecations", "runtime_of", "time_runtimes",
]  # fmt: skip

RUNTIMES = tuple(runtimes.RUNTIMES)
"""The dense runtimes a version can be served with (the manifest's ``dense`` names the file of
each exporting one; ``model_store.devices`` picks among them by ``--device``)."""
AUTO = "auto"
CHOICES = (AUTO, *RUNTIMES)
"""What ``--runtime`` accepts: ``auto`` or a registered runtime."""
UNMEASURED = "torchscript"
"""What ``auto`` serves of a version exported before runtimes were timed."""
TIMED_ROWS = 200
"""Rows of the batch the export times each runtime on: a ranking request's candidates."""


def check_runtime(requested: str) -> None:
    """ValueError naming the choices unless ``requested`` is ``auto`` or a registered runtime."""
    if requested != AUTO and requested not in runtimes.RUNTIMES:
        raise ValueError(
            f"unknown dense runtime {requested!r}; choose {AUTO} or one of {', '.join(RUNTIMES)}"
        )


def runtime_of(manifest: VersionManifest, requested: str = AUTO) -> str:
    """The dense runtime to serve a version with: ``requested``, or for ``auto`` the one its export
    measured faster on the CPU (the manifest's ``dense_runtime.default``; torchscript for versions exported
    before it was measured). ValueError for a runtime the version does not ship."""
    check_runtime(requested)
    if requested == AUTO:
        requested = manifest.dense_runtime.default if manifest.dense_runtime else UNMEASURED
        check_runtime(requested)  # a manifest naming a runtime this release does not know
    if runtimes.get(requested).source not in manifest.dense:
        raise ValueError(f"this version ships no {requested} dense model (it has {sorted(manifest.dense)})")
    return requested


def time_runtimes(
    paths: dict[str, Path],
    pooled: NDArray[Any],
    dense: NDArray[Any],
    num_threads: int = 1,
    seconds: float = 0.3,
) -> dict[str, float]:
    """Median ms of one call of each runtime's model on (pooled, dense), measured in turns (so a
    busy moment of the machine hits all alike) for about ``seconds`` after a warm-up."""
    import time

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        fns = {name: runtimes.get(name).load(path, num_threads) for name, path in paths.items()}
        for fn in fns.values():
            for _ in range(5):
                fn(pooled, dense)
        times: dict[str, list[float]] = {name: [] for name in fns}
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline or min(map(len, times.values())) < 20:
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn(pooled, dense)
                times[name].append((time.perf_counter() - t0) * 1e3)
    finally:
        torch.set_num_threads(before)
    return {name: round(float(np.median(t)), 4) for name, t in times.items()}


def load_dense(path: str | os.PathLike[str], num_threads: int | None = None) -> DenseFn:
    """Load an exported dense model as `(pooled f32 (B,S,D), dense f32 (B,F)) -> logits f32 (B,)`
    with the runtime its suffix names (`.pt` TorchScript, `.onnx` an onnxruntime CPU session, ...;
    `num_threads` sets its intra-op threads, None keeps the runtime's default). Inputs of the wrong
    shape raise ValueError naming the expected shape; an unknown suffix a ValueError naming the
    known ones."""
    return runtimes.for_file(path).load(Path(path), num_threads)
