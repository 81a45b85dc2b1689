"""``make bench-scale``'s serving part at a small size, as a subprocess: two versions written into
a store, two ``recserve ps --follow`` processes, lookups through full switches both ways, the
release, a delta; the JSON holds every key the issue names and no lookup failed."""

import json
import subprocess
import sys

import pytest

from tests.helpers import ROOT


@pytest.mark.slow
def test_bench_scale_serving_runs_small(tmp_path):
    out = tmp_path / "scale.json"
    cmd = [sys.executable, "-m", "loadtest.bench_scale", "--rows", "200000", "--switches", "2", "--window-s", "1",
           "--keep-previous-s", "1", "--delta-rows", "5000", "--rate", "50", "--no-train", "--dir",
           str(tmp_path / "work"), "--out", str(out)]  # fmt: skip
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["serving_rows"] == 200_000 and r["lookup_failures"] == 0 and r["switches"] == 2
    assert [s["to"] for s in r["per_switch"]] == ["2", "1"]
    for key in ("serving_bytes_per_row", "raw_bytes_per_row", "load_s", "load_gb_per_s", "switch_s",
                "lookup_p99_steady_ms", "lookup_p99_during_switch_ms", "peak_rss_during_switch_gb",
                "old_plus_new_gb", "delta_rows_per_s", "lookup_p99_idle_spinner_ms"):  # fmt: skip
        assert r[key] > 0, key
    assert r["lookup_calls_steady"] > 0 and r["lookup_calls_during_switch"] > 0
    assert "lookup p99 during the switches <= 1.5x steady" in r["targets_met"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert not (tmp_path / "work").exists()  # removed without --keep
