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
