import pytest

from model_store import runtimes
from model_store.dense import CHOICES, check_runtime, runtime_of

BOTH = {"torchscript": "dense/model.pt", "onnx": "dense/model.onnx"}


def test_auto_serves_the_runtime_the_export_measured_faster():
    measured = {
        "dense": BOTH,
        "dense_runtime": {"default": "onnx", "p50_ms": {"torchscript": 0.9, "onnx": 0.4}},
    }
    assert runtime_of(measured) == "onnx"
    assert runtime_of(measured, "torchscript") == "torchscript"  # asked for: served as asked
    assert runtime_of({"dense": BOTH}) == "torchscript"  # exported before runtimes were measured


def test_a_runtime_the_version_does_not_ship_is_refused():
    with pytest.raises(ValueError, match="ships no onnx"):
        runtime_of({"dense": {"torchscript": "dense/model.pt"}}, "onnx")
    with pytest.raises(ValueError, match="unknown dense runtime 'tensorrt'"):
        runtime_of({"dense": BOTH}, "tensorrt")


def test_the_runtime_choices_are_auto_and_the_registered_runtimes():
    assert CHOICES == ("auto", *runtimes.RUNTIMES)
    check_runtime("onnx")
    with pytest.raises(ValueError, match="unknown dense runtime 'tensorrt'; choose auto or one of"):
        check_runtime("tensorrt")
