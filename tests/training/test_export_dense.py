"""Export writes every exporting runtime, verifies each against torch and times them; a runtime
whose scores differ from torch's stops the export."""

from __future__ import annotations

import pytest

from model_store import runtimes
from tests.model_store.runtimes.test_registry import inputs, make
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
