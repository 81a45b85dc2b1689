import pytest

from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow  # a process of its own, as every bench's smoke run


def test_bench_trainer_trains_the_same_samples_offline_and_streaming_to_the_same_model(bench, trained):
    result = bench("bench_trainer", "trainer", "--store", str(trained[0]))
    has(result, "samples", "batches", "broker_consume_samples_per_s", "targets_met", "machine")
    assert set(result["batches"]) == {"128", "1024"}
    for b in result["batches"].values():
        has(b, "offline_samples_per_s", "streaming_samples_per_s", "ratio", "offline_auc", "streaming_auc",
            "streaming_progressive_auc", "recserve_train_samples_per_s")  # fmt: skip
        assert b["samples"] == {"offline": result["samples"], "streaming": result["samples"]}
        assert b["ratio"] == pytest.approx(
            b["streaming_samples_per_s"] / b["offline_samples_per_s"], abs=1e-3
        )
        # the same samples into the same version by the same step: the same model, whichever way they came
        assert abs(b["streaming_auc"] - b["offline_auc"]) < 0.005, b
