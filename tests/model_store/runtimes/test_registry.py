"""The contract every registered dense runtime keeps, checked for each one the registry holds (a
new runtime's file is tested here without a line of its own): export in eval mode and hand the
model back as it was, load, score as torch does on every model kind and on a batch size other than
the export's, refuse inputs of the wrong shape by name. And the registry refuses what it does not
know."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_store import runtimes
from model_store.dense import load_dense
from model_store.runtimes import DenseRuntime
from tests.cuda import needs_cuda
from tests.model_store.runtimes.helpers import F, inputs, make
from training.config import ARCHS

NAMES = [pytest.param(n, marks=needs_cuda) if r.device == "cuda" else n for n, r in runtimes.RUNTIMES.items()]
"""Every registered runtime; those on a GPU skip without CUDA (naming it)."""


def test_the_cpu_and_cuda_runtimes_are_registered() -> None:
    assert {"torchscript", "onnx"} <= set(runtimes.EXPORTS)
    assert {"torchscript-cuda", "cuda-graphs"} <= set(runtimes.RUNTIMES) - set(runtimes.EXPORTS)
    assert all(r.name == name and r.file.startswith("dense/") for name, r in runtimes.RUNTIMES.items())
    for name in ("torchscript-cuda", "cuda-graphs"):  # they run the TorchScript export, write nothing
        cuda = runtimes.get(name)
        assert (cuda.device, cuda.source, cuda.export, cuda.file) == (
            "cuda",
            "torchscript",
            None,
            "dense/model.pt",
        )
    assert runtimes.for_file("x/model.pt").name == "torchscript"  # a bare file: its CPU runtime


def write(name: str, model: torch.nn.Module, tmp_path, pooled: np.ndarray, dense: np.ndarray):
    """``name``'s model file (written by the runtime whose export it runs) under ``tmp_path``."""
    runtime = runtimes.get(name)
    return runtimes.get(runtime.source).write(model, tmp_path / runtime.file, pooled, dense)


@pytest.mark.parametrize("num_dense", [F, 0])
@pytest.mark.parametrize("kind", ARCHS)
@pytest.mark.parametrize("name", NAMES)
def test_export_load_score_as_torch(name: str, kind: str, num_dense: int, tmp_path) -> None:
    runtime = runtimes.get(name)
    model = make(kind, num_dense, dropout=0.2).train()  # the export must switch dropout off
    path = write(name, model, tmp_path, *inputs(4, num_dense))
    assert path == tmp_path / runtime.file and model.training  # handed back in its original mode
    pooled, dense = inputs(2100, num_dense, seed=7)  # above the largest CUDA-graph bucket
    with torch.no_grad():
        expected = model.eval()(torch.from_numpy(pooled), torch.from_numpy(dense)).numpy()
    for predict in (runtime.load(path, 1), load_dense(path)):  # by name, and by the file's suffix
        got = predict(pooled, dense)
        assert got.shape == (2100,) and got.dtype == np.float32
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_inputs_of_the_wrong_shape_are_refused_by_name(name: str, tmp_path) -> None:
    runtime = runtimes.get(name)
    predict = runtime.load(write(name, make("fm"), tmp_path, *inputs(2)), None)
    pooled, dense = inputs(3)
    with pytest.raises(ValueError, match=r"pooled must be \(B, 5, 8\)"):
        predict(pooled[:, :4], dense)
    with pytest.raises(ValueError, match=r"dense must be \(3, 3\)"):
        predict(pooled, dense[:2])


def test_the_registry_refuses_what_it_does_not_know(tmp_path) -> None:
    with pytest.raises(ValueError, match="unknown dense runtime 'tensorrt'; known runtimes: .*onnx"):
        runtimes.get("tensorrt")
    with pytest.raises(ValueError, match=r"unknown dense model format '\.bin'; expected one of .*\.pt"):
        load_dense(tmp_path / "dense.bin")
    onnx = runtimes.get("onnx")
    with pytest.raises(ValueError, match="'onnx' registered twice"):
        runtimes.register(onnx)
    with pytest.raises(ValueError, match="has the suffix of onnx's"):
        runtimes.register(DenseRuntime("other", "dense/other.onnx", onnx.export, onnx.load))
    with pytest.raises(ValueError, match="give either an exporter or the runtime it runs"):
        runtimes.register(DenseRuntime("other", "dense/model.pt", onnx.export, onnx.load, of="torchscript"))
    with pytest.raises(ValueError, match="runs 'torchscript''s export: register that first, same file"):
        runtimes.register(DenseRuntime("other", "dense/other.pt", None, onnx.load, "cuda", of="torchscript"))
    with pytest.raises(ValueError, match="writes nothing: it runs torchscript's export"):
        runtimes.get("cuda-graphs").write(make("fm"), tmp_path / "model.pt", *inputs(2))
    assert "other" not in runtimes.RUNTIMES
