import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_bench_train_runs_both_sections_and_every_variant(bench):
    result = bench("bench_train", "train")
    criteo, synth = result["criteo"], result["synth_1m"]
    for name in ("inprocess", "sync", "hybrid"):
        has(criteo[name], "auc", "logloss", "samples_per_s", "auc_per_seed")
    has(criteo, "conditions", "targets")
    for name in ("peer", "inprocess", "sync", "hybrid", "planned", "planned_half"):
        has(synth[name], "auc", "logloss", "samples_per_s", "wall_s", "peak_rss_gb")
        assert synth[name]["peak_rss_gb"] > 0.05, synth[name]  # the sampler saw the process
    has(synth, "conditions", "targets")
    for data_set in (criteo, synth):
        q = data_set["quantized"]
        has(q, "float32_auc", "float16", "int8", "targets")
        for dtype in ("float16", "int8"):
            has(q[dtype], "auc", "max_abs_score_diff", "bytes_per_row")
            assert 0 < q[dtype]["max_abs_score_diff"] < 0.05, q
        assert q["int8"]["bytes_per_row"] == 8 + 16 + 4 < q["float16"]["bytes_per_row"] == 8 + 32
