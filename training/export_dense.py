"""Export the dense network (TorchScript `.pt`, ONNX `.onnx`) and verify the export; serving loads
it with `model_store.dense.load_dense`.

The exported graph has the model contract of `training.models`: inputs `pooled` (B, S, D) and
`dense` (B, F) float32, output `logits` (B,), batch axis dynamic. `load_dense` gives serving one
numpy-in/numpy-out callable whichever format was exported (used here to verify the ONNX file).

Both exporters used here are deprecated in torch 2.13 (`torch.jit.script`, and the TorchScript-
based ONNX exporter; the new one needs `onnxscript`, not a dependency). They still work and
TorchServe still loads `.pt`, so their deprecation warnings are silenced here, in one place.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from model_store.dense import OUTPUT_NAME, DenseFn, as_array, load_dense, quiet_deprecations  # noqa: F401

ONNX_OPSET = 17
INPUT_NAMES = ("pooled", "dense")


class ExportVerificationError(RuntimeError):
    """The exported model does not reproduce the torch model's outputs."""


@contextmanager
def _eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Export in eval mode (no dropout), then give the trainer its model back as it was."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def _unwrap(model: nn.Module) -> nn.Module:
    """The inner module of a DistributedDataParallel wrapper (export the model, not the wrapper)."""
    inner = getattr(model, "module", None)
    return inner if isinstance(model, nn.parallel.DistributedDataParallel) and inner is not None else model


def _as_tensor(x: Tensor | np.ndarray, like: nn.Module) -> Tensor:
    """float32 on the model's device (the trainer's model may live on a GPU)."""
    t = x if isinstance(x, Tensor) else torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    device = next(iter(like.parameters())).device
    return t.detach().to(device=device, dtype=torch.float32)


def export_torchscript(model: nn.Module, path: str | os.PathLike) -> Path:
    """Script `model` (eval mode) and save it; `torch.jit.load(path)` needs no recserve code."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _eval_mode(_unwrap(model)) as m, quiet_deprecations():
        scripted = torch.jit.script(m)
        scripted.eval()
        torch.jit.save(scripted, str(path))
    return path


def export_onnx(
    model: nn.Module,
    path: str | os.PathLike,
    example_pooled: Tensor | np.ndarray,
    example_dense: Tensor | np.ndarray,
) -> Path:
    """Export to ONNX (opset 17) with a dynamic batch axis.

    When the model has no dense features the exporter drops the unused `dense` input from the
    graph; `load_dense` feeds only the inputs the graph declares.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    batch = {0: "batch"}
    with _eval_mode(_unwrap(model)) as m, quiet_deprecations(), torch.no_grad():
        torch.onnx.export(
            m,
            (_as_tensor(example_pooled, m), _as_tensor(example_dense, m)),
            str(path),
            dynamo=False,
            opset_version=ONNX_OPSET,
            input_names=list(INPUT_NAMES),
            output_names=[OUTPUT_NAME],
            dynamic_axes={"pooled": batch, "dense": batch, OUTPUT_NAME: batch},
        )
    return path


def verify_onnx(
    path: str | os.PathLike,
    model: nn.Module,
    pooled: Tensor | np.ndarray,
    dense: Tensor | np.ndarray,
    atol: float = 1e-5,
    rtol: float = 0.0,
) -> float:
    """Max abs difference between onnxruntime (CPU) and torch logits on these inputs.

    Raises ExportVerificationError where any row differs by more than `atol + rtol * |logit|`
    (or the shapes differ), so an export that does not reproduce the trainer's scores is never
    published. Why `rtol`: float32 carries ~7 digits, so two correct runtimes that sum in a
    different order differ by ~1e-6 at |logit| ~ 10; logits far from 0 may need a relative bound.
    """
    with _eval_mode(_unwrap(model)) as m, torch.no_grad():
        expected = m(_as_tensor(pooled, m), _as_tensor(dense, m)).cpu().numpy()
    got = load_dense(path)(as_array(pooled), as_array(dense))
    if got.shape != expected.shape:
        raise ExportVerificationError(f"{path}: ONNX logits shape {got.shape} != torch {expected.shape}")
    err = np.abs(got - expected)
    diff = float(err.max()) if err.size else 0.0
    bad = ~(err <= atol + rtol * np.abs(expected))  # NaN counts as bad
    if bad.any():
        raise ExportVerificationError(
            f"{path}: ONNX logits differ from torch by up to {diff:.3g} (max abs); "
            f"{int(bad.sum())} of {err.size} rows exceed atol={atol:g} + rtol={rtol:g} * |logit|"
        )
    return diff


def build_tensorrt_engine(
    onnx_path: str | os.PathLike, engine_path: str | os.PathLike, max_batch: int = 1024
) -> Path:
    """Optional GPU path: build a serialized TensorRT engine from the ONNX export.

    Raises RuntimeError("TensorRT not available ...") where tensorrt or a CUDA device is missing
    (the default CPU install). Not exercised by the CPU test suite.
    """
    try:
        import tensorrt as trt  # type: ignore[import-not-found, unused-ignore]  # GPU extra only, no stubs
    except ImportError as e:
        raise RuntimeError("TensorRT not available: install the 'gpu' extra on a CUDA machine") from e
    if not torch.cuda.is_available():
        raise RuntimeError("TensorRT not available: no CUDA device")

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(Path(onnx_path).read_bytes()):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        inp = network.get_input(i)
        rest = tuple(inp.shape)[1:]
        profile.set_shape(inp.name, (1, *rest), (max_batch, *rest), (max_batch, *rest))
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise RuntimeError(f"TensorRT failed to build an engine from {onnx_path}")
    engine_path = Path(engine_path)
    engine_path.write_bytes(bytes(engine))
    return engine_path
