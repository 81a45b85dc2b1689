"""Load an exported dense model for serving: one numpy-in/numpy-out callable whichever format
was exported (TorchScript ``.pt`` or ONNX ``.onnx``).

The model contract (``training.models``): inputs ``pooled`` (B, S, D) and ``dense`` (B, F)
float32, output ``logits`` (B,), batch axis dynamic. ``torch.jit.load`` is deprecated in torch
2.13 but still works and TorchServe still loads ``.pt``, so its warnings are silenced here, in
one place (the exporter in ``training.export_dense`` uses the same guard).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

if TYPE_CHECKING:
    import torch

    from model_store.manifest import VersionManifest

OUTPUT_NAME = "logits"
RUNTIMES = ("torchscript", "onnx")
"""The dense runtimes a version ships (the manifest's ``dense`` names each one's file)."""
AUTO = "auto"
TIMED_ROWS = 200
"""Rows of the batch the export times each runtime on: a ranking request's candidates."""

DenseFn = Callable[[NDArray[Any], NDArray[Any]], NDArray[np.float32]]
"""(pooled (B, S, D), dense (B, F)) -> logits (B,), float32."""


@contextmanager
def quiet_deprecations() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\..*")
        warnings.filterwarnings("ignore", message=r".*legacy TorchScript-based ONNX export.*")
        warnings.filterwarnings("ignore", message=r".*torch\.jit\.(script|load). is deprecated.*")
        warnings.filterwarnings("ignore", message=r".*feature will be removed.*")
        yield


def as_array(x: ArrayLike | torch.Tensor) -> NDArray[np.float32]:
    """float32, C-contiguous (a torch tensor is copied to the host first)."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.ascontiguousarray(x, dtype=np.float32)


def _check_inputs(
    pooled: NDArray[np.float32], dense: NDArray[np.float32], slots: int, dim: int, num_dense: int
) -> None:
    """Shape errors with a message naming the problem, instead of a deep runtime error."""
    if pooled.ndim != 3 or pooled.shape[1:] != (slots, dim):
        raise ValueError(f"pooled must be (B, {slots}, {dim}), got {pooled.shape}")
    if dense.ndim != 2 or dense.shape != (pooled.shape[0], num_dense):
        raise ValueError(f"dense must be ({pooled.shape[0]}, {num_dense}), got {dense.shape}")


def _load_torchscript(path: Path) -> DenseFn:
    import torch

    with quiet_deprecations():
        module = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]  # unannotated in torch
    module.eval()
    shape = (int(module.num_slots), int(module.dim), int(module.num_dense))

    def predict(pooled: NDArray[Any], dense: NDArray[Any]) -> NDArray[np.float32]:
        p, d = as_array(pooled), as_array(dense)
        _check_inputs(p, d, *shape)
        with torch.inference_mode():
            logits: NDArray[np.float32] = module(torch.from_numpy(p), torch.from_numpy(d)).numpy()
        return logits

    return predict


def _load_onnx(path: Path, num_threads: int | None) -> DenseFn:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if num_threads is not None:
        opts.intra_op_num_threads = num_threads
    session = ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    inputs = {i.name: i.shape for i in session.get_inputs()}
    if "pooled" not in inputs:
        raise ValueError(f"{path}: not a recserve dense model (inputs {sorted(inputs)}, no 'pooled')")
    slots, dim = int(inputs["pooled"][1]), int(inputs["pooled"][2])
    num_dense = int(inputs["dense"][1]) if "dense" in inputs else 0

    def predict(pooled: NDArray[Any], dense: NDArray[Any]) -> NDArray[np.float32]:
        p, d = as_array(pooled), as_array(dense)
        _check_inputs(p, d, slots, dim, num_dense)
        feed = {"pooled": p, "dense": d} if "dense" in inputs else {"pooled": p}
        logits: NDArray[np.float32] = session.run([OUTPUT_NAME], feed)[0]
        return logits

    return predict


def check_runtime(requested: str) -> None:
    """ValueError naming the choices unless ``requested`` is ``auto`` or one of RUNTIMES."""
    if requested != AUTO and requested not in RUNTIMES:
        raise ValueError(
            f"unknown dense runtime {requested!r}; choose {AUTO} or one of {', '.join(RUNTIMES)}"
        )


def runtime_of(manifest: VersionManifest, requested: str = AUTO) -> str:
    """The dense runtime to serve a version with: ``requested``, or for ``auto`` the one its export
    measured faster (the manifest's ``dense_runtime.default``; torchscript for versions exported
    before it was measured). ValueError for a runtime the version does not ship."""
    check_runtime(requested)
    if requested == AUTO:
        requested = manifest.dense_runtime.default if manifest.dense_runtime else "torchscript"
        check_runtime(requested)  # a manifest naming a runtime this release does not know
    if requested not in manifest.dense:
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
    busy moment of the machine hits both alike) for about ``seconds`` after a warm-up."""
    import time

    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        fns = {name: load_dense(path, num_threads=num_threads) for name, path in paths.items()}
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
    """Load an exported dense model as `(pooled f32 (B,S,D), dense f32 (B,F)) -> logits f32 (B,)`.

    `.pt` is loaded with torch.jit.load, `.onnx` with an onnxruntime CPU session (`num_threads`
    sets its intra-op threads; None keeps onnxruntime's default). Inputs of the wrong shape raise
    ValueError naming the expected shape.
    """
    path = Path(path)
    if path.suffix == ".pt":
        return _load_torchscript(path)
    if path.suffix == ".onnx":
        return _load_onnx(path, num_threads)
    raise ValueError(f"{path}: unknown dense model format {path.suffix!r}; expected .pt or .onnx")
