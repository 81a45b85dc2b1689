"""Runtime choice by ``--device``, on any host: ``cuda`` refused without CUDA (naming it), ``auto``
on the CPU without it (saying so), a runtime of another device refused, and where a GPU is in the
choice the fastest runtime timed on the host serves (the timer faked: the choice is plain code)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from model_store.devices import DEVICES, NO_CUDA, check_device, choose, fastest, timing_batch
from model_store.manifest import RuntimeChoice, VersionManifest

SHIPS = {"torchscript": "dense/model.pt", "onnx": "dense/model.onnx"}


def _manifest(dense: dict[str, str] = SHIPS) -> VersionManifest:
    return VersionManifest("m", "1", "fp", dim=4, num_shards=1, dense=dense,
                           dense_runtime=RuntimeChoice("onnx", {"onnx": 0.1, "torchscript": 0.2}, rows=200),
                           model_config={"num_slots": 3, "num_dense": 2})  # fmt: skip


def _timer(ms: dict[str, float], calls: list[dict[str, Path]]):
    def timer(paths, pooled, dense, threads):
        calls.append(paths)
        assert pooled.shape == (200, 3, 4) and dense.shape == (200, 2) and threads == 1
        return {name: ms[name] for name in paths}

    return timer


def _untimed(*_):
    raise AssertionError("nothing is timed here")


def test_cuda_without_cuda_is_refused_naming_it() -> None:
    assert DEVICES == ("cpu", "cuda", "auto")
    with pytest.raises(ValueError, match=re.escape(f"--device cuda: {NO_CUDA}")):
        check_device("cuda", cuda=False)
    with pytest.raises(ValueError, match="--runtime cuda-graphs: torch sees no CUDA device"):
        check_device("auto", "cuda-graphs", cuda=False)
    with pytest.raises(ValueError, match="--device cuda: torch sees no CUDA device"):
        choose(_manifest(), Path("v"), "cuda", cuda=False, timer=_untimed)
    check_device("cuda", cuda=True)
    check_device("auto", "onnx", cuda=False)


def test_a_runtime_of_another_device_or_an_unknown_name_is_refused() -> None:
    with pytest.raises(ValueError, match="--runtime cuda-graphs runs on cuda, not on --device cpu"):
        check_device("cpu", "cuda-graphs", cuda=True)
    with pytest.raises(ValueError, match="--runtime onnx runs on cpu, not on --device cuda"):
        check_device("cuda", "onnx", cuda=True)
    with pytest.raises(ValueError, match="unknown device 'tpu'; choose one of cpu, cuda, auto"):
        check_device("tpu")
    with pytest.raises(ValueError, match="unknown dense runtime 'tensorrt'"):
        check_device("cuda", "tensorrt", cuda=True)


def test_auto_without_cuda_serves_the_exports_choice_on_the_cpu_and_says_so() -> None:
    got = choose(_manifest(), Path("v"), "auto", cuda=False, timer=_untimed)
    assert (got.runtime, got.device, got.timings_ms) == ("onnx", "cpu", {})
    assert "no CUDA device" in got.why
    assert (
        choose(_manifest(), Path("v"), "cpu", cuda=True, timer=_untimed).runtime == "onnx"
    )  # no timing on cpu


def test_with_cuda_the_fastest_runtime_timed_on_this_host_serves() -> None:
    ms = {"onnx": 0.5, "torchscript": 0.4, "torchscript-cuda": 0.3, "cuda-graphs": 0.1}
    calls: list[dict[str, Path]] = []
    got = choose(_manifest(), Path("v"), "cuda", cuda=True, timer=_timer(ms, calls))
    assert (got.runtime, got.device, got.source) == ("cuda-graphs", "cuda", "torchscript")
    assert calls == [{"torchscript-cuda": Path("v/dense/model.pt"), "cuda-graphs": Path("v/dense/model.pt")}]
    assert (
        got.timings_ms == {"torchscript-cuda": 0.3, "cuda-graphs": 0.1} and "fastest on this host" in got.why
    )
    calls.clear()
    slow_gpu = ms | {"torchscript-cuda": 0.9, "cuda-graphs": 0.8}  # auto: the CPU wins where it is faster
    got = choose(_manifest(), Path("v"), "auto", cuda=True, timer=_timer(slow_gpu, calls))
    assert (got.runtime, got.device) == ("torchscript", "cpu") and set(calls[0]) == set(ms)
    # a version without its TorchScript file: no CUDA runtime can run it
    calls.clear()
    got = choose(
        _manifest({"onnx": "dense/model.onnx"}), Path("v"), "auto", cuda=True, timer=_timer(ms, calls)
    )
    assert got.runtime == "onnx" and set(calls[0]) == {"onnx"}
    with pytest.raises(ValueError, match="ships no dense model that runs on cuda"):
        choose(_manifest({"onnx": "dense/model.onnx"}), Path("v"), "cuda", cuda=True, timer=_untimed)


def test_a_runtime_asked_for_is_served_as_asked_untimed() -> None:
    got = choose(_manifest(), Path("v"), "auto", "cuda-graphs", cuda=True, timer=_untimed)
    assert (got.runtime, got.device, got.why) == ("cuda-graphs", "cuda", "--runtime cuda-graphs")
    with pytest.raises(ValueError, match="ships no torchscript dense model"):
        choose(_manifest({"onnx": "dense/model.onnx"}), Path("v"), "cuda", "cuda-graphs", cuda=True)


def test_fastest_and_the_timing_batch() -> None:
    assert fastest({"a": 2.0, "b": 1.0, "c": 1.0}) == "b"  # the first registered among equals
    with pytest.raises(ValueError, match="no runtime was timed"):
        fastest({})
    pooled, dense = timing_batch(_manifest())
    assert pooled.shape == (200, 3, 4) and dense.shape == (200, 2) and pooled.std() > 0.5
    with pytest.raises(ValueError, match="records no input shapes"):
        timing_batch(VersionManifest("m", "1", "fp", dim=4, num_shards=1))
