"""The CUDA runtimes: their feed runs on the CPU here (the module's own device), their loaders
refuse a host without CUDA by name, and on a GPU they score as the CPU does at every bucket size
and above the largest (the registry's contract, test_registry.py, covers the rest on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from model_store import runtimes
from model_store.runtimes import torchscript
from model_store.runtimes.torchscript_cuda import eager_forward
from model_store.staging import Buckets, Staging, run_chunks
from tests.cuda import needs_cuda, without_cuda
from tests.model_store.runtimes.helpers import D, F, S, inputs, make

CUDA_RUNTIMES = ("torchscript-cuda", "cuda-graphs")


@pytest.fixture
def exported(tmp_path):
    model = make("dlrm").eval()
    return model, torchscript.RUNTIME.write(model, tmp_path / "model.pt", *inputs(2))


@pytest.mark.filterwarnings("ignore:.*torch.jit.load. is deprecated:DeprecationWarning")
def test_the_eager_feed_scores_as_the_module_on_whatever_device_it_lies(exported) -> None:
    model, path = exported
    module = torchscript.load_module(path)
    pooled, dense = inputs(300)
    feed = eager_forward(module, torch.device("cpu"), S, D)
    with torch.inference_mode():
        got = run_chunks(pooled, dense, Buckets((64, 128)), Staging(S, D, F, pin=False), feed)
        want = model(torch.from_numpy(pooled), torch.from_numpy(dense)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@without_cuda
@pytest.mark.parametrize("name", CUDA_RUNTIMES)
def test_loading_on_a_host_without_cuda_is_refused_naming_it(name: str, exported) -> None:
    with pytest.raises(RuntimeError, match="need a CUDA device; torch sees none"):
        runtimes.get(name).load(exported[1], None)


@needs_cuda
@pytest.mark.parametrize("name", CUDA_RUNTIMES)
def test_on_a_gpu_every_bucket_and_beyond_scores_as_the_cpu(name: str, exported) -> None:
    model, path = exported
    predict = runtimes.get(name).load(path, None)
    for rows in (1, 64, 200, 2048, 5000):
        pooled, dense = inputs(rows, seed=rows)
        with torch.no_grad():
            want = model(torch.from_numpy(pooled), torch.from_numpy(dense)).numpy()
        for _ in range(2):  # the staging buffers and static inputs are reused
            np.testing.assert_allclose(predict(pooled, dense), want, rtol=1e-4, atol=1e-5)
