"""ONNX: a model without dense features exports a graph without the ``dense`` input, and serving
feeds only the inputs the graph declares."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from model_store.runtimes import onnx
from tests.model_store.runtimes.helpers import inputs, make


def test_a_model_without_dense_features_has_no_dense_input(tmp_path) -> None:
    model = make("dlrm", num_dense=0).eval()
    path = onnx.RUNTIME.write(model, tmp_path / "dense.onnx", *inputs(2, 0))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["pooled"]
    assert [o.name for o in session.get_outputs()] == ["logits"]
    pooled, dense = inputs(5, 0)
    assert onnx.load(path, 1)(pooled, dense).shape == (5,)
    with np.testing.assert_raises_regex(ValueError, r"dense must be \(5, 0\)"):
        onnx.load(path, 1)(pooled, np.zeros((5, 1), np.float32))
