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

OUTPUT_NAME = "logits"

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
