"""``make bench-multihost``'s training half (``--only training``)."""

import pytest

from loadtest import netns
from tests.loadtest.conftest import has

pytestmark = pytest.mark.slow


def test_bench_multihost_training_half_kills_a_rank_and_resumes(bench):
    if reason := netns.unavailable():
        pytest.skip(f"bench-multihost needs network namespaces: {reason}")
    result = bench("bench_multihost", "multihost", "--only", "training")
    has(result["training"], "auc_uninterrupted", "auc_resumed", "resume_auc_delta", "train_samples_per_s_2_nodes",
        "train_samples_per_s_1_node")  # fmt: skip
    has(result, "targets_met", "quick")
