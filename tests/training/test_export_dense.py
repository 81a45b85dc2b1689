"""Export writes every exporting runtime, verifies each against torch and times them; a runtime
whose scores differ from torch's stops the export."""

from __future__ import annotations

import pytest

from model_store import runtimes
from model_store.manifest import RuntimeChoice
from tests.model_store.runtimes.helpers import inputs, make
from training.export_dense import ExportVerificationError, export_dense, verify


def test_every_exporting_runtime_is_written_verified_and_timed(tmp_path) -> None:
    model = make("deepfm").eval()
    exported = export_dense(model, tmp_path, *inputs(7))
    assert exported.files == {name: r.file for name, r in runtimes.EXPORTS.items()}
    assert all((tmp_path / f).is_file() for f in exported.files.values())
    assert set(exported.max_abs_diff) == set(runtimes.EXPORTS)
    assert all(0 <= d <= 1e-4 for d in exported.max_abs_diff.values())
    p50 = exported.timing.p50_ms
    assert isinstance(p50, dict) and set(p50) == set(runtimes.EXPORTS) and all(v > 0 for v in p50.values())
    assert exported.timing.default == min(p50, key=p50.get) and exported.timing.rows == 200


@pytest.mark.parametrize("name", list(runtimes.EXPORTS))
def test_an_export_of_another_model_is_refused(name: str, tmp_path) -> None:
    runtime = runtimes.get(name)
    path = runtime.write(make("dlrm"), tmp_path / runtime.file, *inputs(2))
    other = make("dlrm", seed=9).eval()
    with pytest.raises(ExportVerificationError, match=f"{name} logits differ from torch"):
        verify(runtime, path, other, *inputs(5))
    # a relative bound admits what float32 rounding would, not a different model
    with pytest.raises(ExportVerificationError):
        verify(runtime, path, other, *inputs(5), atol=0.0, rtol=1e-3)
    assert verify(runtime, path, make("dlrm").eval(), *inputs(5)) <= 1e-5


def test_a_timing_of_the_same_runtimes_is_kept_another_is_timed_again(tmp_path) -> None:
    """A full version from the stream keeps its parent's choice (same network, same runtimes):
    timing on a busy trainer's host picked runtimes by noise, version to version."""
    model = make("dlrm").eval()
    names = list(runtimes.EXPORTS)
    parent = RuntimeChoice(names[-1], {n: 1.0 + i for i, n in enumerate(names)}, 200)
    kept = export_dense(model, tmp_path / "a", *inputs(7), timed=parent)
    assert kept.timing is parent and set(kept.max_abs_diff) == set(names)
    other = RuntimeChoice("torchscript_cuda", {"torchscript_cuda": 0.1}, 200)  # timed on another host
    timed = export_dense(model, tmp_path / "b", *inputs(7), timed=other)
    assert set(timed.timing.p50_ms) == set(names) and timed.timing.default == min(
        timed.timing.p50_ms, key=timed.timing.p50_ms.get
    )
