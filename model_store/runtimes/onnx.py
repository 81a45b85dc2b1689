"""ONNX (opset 17, dynamic batch axis), run with an onnxruntime CPU session.

The exporter is torch's TorchScript-based one (``dynamo=False``: the new one needs
``onnxscript``, not a dependency). When the model has no dense features it drops the unused
``dense`` input from the graph; ``load`` feeds only the inputs the graph declares.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from model_store.runtimes.base import (
    INPUT_NAMES,
    OUTPUT_NAME,
    DenseFn,
    DenseRuntime,
    as_array,
    check_inputs,
)
from model_store.runtimes.registry import register

if TYPE_CHECKING:
    from torch import nn

OPSET = 17


def export(model: nn.Module, path: Path, pooled: NDArray[np.float32], dense: NDArray[np.float32]) -> None:
    import torch

    device = next(iter(model.parameters())).device  # the trainer's model may live on a GPU
    example = tuple(torch.from_numpy(x).to(device) for x in (pooled, dense))
    batch = {0: "batch"}
    torch.onnx.export(
        model,
        example,
        str(path),
        dynamo=False,
        opset_version=OPSET,
        input_names=list(INPUT_NAMES),
        output_names=[OUTPUT_NAME],
        dynamic_axes={"pooled": batch, "dense": batch, OUTPUT_NAME: batch},
    )


def load(path: Path, num_threads: int | None) -> DenseFn:
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
        check_inputs(p, d, slots, dim, num_dense)
        feed = {"pooled": p, "dense": d} if "dense" in inputs else {"pooled": p}
        logits: NDArray[np.float32] = session.run([OUTPUT_NAME], feed)[0]
        return logits

    return predict


RUNTIME = register(
    DenseRuntime("onnx", "dense/model.onnx", export, load, modules=("torch.onnx", "onnxruntime"))
)
