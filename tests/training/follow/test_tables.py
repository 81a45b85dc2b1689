"""The follower's learning rate: --lr when given, else the version's scaled by the batch."""

from __future__ import annotations

import pytest

from training.follow.config import FollowConfig
from training.follow.tables import learning_rate


def _cfg(**kw) -> FollowConfig:
    return FollowConfig(follow="store/criteo", stream="kafka://b/samples", **kw)


def test_the_rate_given_wins():
    assert learning_rate(_cfg(lr=0.02), 0.005, 128) == 0.02


@pytest.mark.parametrize(("batch", "trained_batch", "lr"), [(1024, 128, 0.04), (128, 128, 0.005), (64, 128, 0.0025),
                                                            (1024, None, 0.005)])  # fmt: skip
def test_unset_it_is_the_versions_scaled_by_the_batch_over_the_versions_batch(batch, trained_batch, lr):
    assert learning_rate(_cfg(batch_size=batch), 0.005, trained_batch) == pytest.approx(lr)


def test_the_default_batch_is_one_that_keeps_up():
    assert FollowConfig.batch_size == 1024
