"""TorchScript: the scripted module reproduces torch bit for bit and loads without recserve code."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from model_store.runtimes import torchscript
from tests.model_store.runtimes.helpers import F, inputs, make
from training.models import ARCHS


@pytest.mark.filterwarnings("ignore:.*torch.jit.load. is deprecated:DeprecationWarning")
@pytest.mark.parametrize("num_dense", [F, 0])
@pytest.mark.parametrize("kind", ARCHS)
def test_round_trip_exact(kind: str, num_dense: int, tmp_path) -> None:
    model = make(kind, num_dense).eval()
    path = torchscript.RUNTIME.write(model, tmp_path / "dense.pt", *inputs(2, num_dense))
    pooled, dense = (torch.from_numpy(x) for x in inputs(6, num_dense))
    loaded = torch.jit.load(str(path))  # plain torch: what TorchServe does
    with torch.no_grad():
        expected = model(pooled, dense)
        for _ in range(3):  # the profiling executor re-optimises after warm-up runs
            assert torch.equal(loaded(pooled, dense), expected)
    served = torchscript.load(path, None)(pooled.numpy(), dense.numpy())
    assert torch.equal(torch.from_numpy(served), expected)
    frozen = torchscript.load_module(path)  # what the follower trains through
    assert not frozen.training and torch.equal(frozen(pooled, dense), expected)


@pytest.mark.filterwarnings("ignore:.*torch.jit.load. is deprecated:DeprecationWarning")
def test_a_model_runs_at_its_thread_count_in_whichever_thread_scores(tmp_path) -> None:
    """torch's intra-op count is a per-thread OpenMP setting: a frontend loads in one thread and
    scores in another, which must not keep its own (a spinning second thread, 4x the latency)."""
    path = torchscript.RUNTIME.write(make("dlrm", F).eval(), tmp_path / "dense.pt", *inputs(2, F))
    predict = torchscript.load(path, 1)
    seen: list[int] = []

    def score() -> None:
        torch.set_num_threads(2)  # what a thread that ran torch before the load holds
        predict(*inputs(4, F))
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=score)
    thread.start()
    thread.join()
    assert seen == [1]


@pytest.mark.filterwarnings("ignore:.*torch.jit.load. is deprecated:DeprecationWarning")
@pytest.mark.filterwarnings("error::UserWarning")
def test_read_only_inputs_score_as_writable_ones_without_torchs_warning(tmp_path) -> None:
    """A binary request's dense values are a view of its body (read-only): they are copied before
    torch.from_numpy, which warns of undefined behaviour on a read-only array."""
    path = torchscript.RUNTIME.write(make("dlrm", F).eval(), tmp_path / "dense.pt", *inputs(2, F))
    predict = torchscript.load(path, 1)
    pooled, dense = inputs(4, F)
    views = [np.frombuffer(x.tobytes(), np.float32).reshape(x.shape) for x in (pooled, dense)]
    assert not any(v.flags.writeable for v in views)
    assert np.array_equal(predict(*views), predict(pooled, dense))
