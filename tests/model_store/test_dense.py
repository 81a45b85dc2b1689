import pytest

from model_store import runtimes
from model_store.dense import CHOICES, check_runtime, runtime_of
from model_store.manifest import RuntimeChoice, VersionManifest

BOTH = {"torchscript": "dense/model.pt", "onnx": "dense/model.onnx"}


def _manifest(dense: dict[str, str], runtime: RuntimeChoice | None = None) -> VersionManifest:
    return VersionManifest("m", "1", "fp", dim=4, num_shards=1, dense=dense, dense_runtime=runtime)


def test_auto_serves_the_runtime_the_export_measured_faster():
    measured = _manifest(BOTH, RuntimeChoice("onnx", {"torchscript": 0.9, "onnx": 0.4}))
    assert runtime_of(measured) == "onnx"
    assert runtime_of(measured, "torchscript") == "torchscript"  # asked for: served as asked
    assert runtime_of(_manifest(BOTH)) == "torchscript"  # exported before runtimes were measured


def test_a_runtime_the_version_does_not_ship_is_refused():
    with pytest.raises(ValueError, match="ships no onnx"):
        runtime_of(_manifest({"torchscript": "dense/model.pt"}), "onnx")
    with pytest.raises(ValueError, match="unknown dense runtime 'tensorrt'"):
        runtime_of(_manifest(BOTH), "tensorrt")


def test_the_runtime_choices_are_auto_and_the_registered_runtimes():
    assert CHOICES == ("auto", *runtimes.RUNTIMES)
    check_runtime("onnx")
    with pytest.raises(ValueError, match="unknown dense runtime 'tensorrt'; choose auto or one of"):
        check_runtime("tensorrt")
