"""The streaming trainer (``recserve train --follow``): it trains the served version from files or a
stream of samples and cuts deltas into it. The nouns are in ``types``; the work is in the modules
beside it (``trainer``, ``steps``, ``book``, ``ranks``, ``current`` (the version to follow next),
``cut`` (the one delta cut: ``DeltaCut``, ``DeltaWriter``), ``standby``, ``tables``,
``full_version``, ``canary`` (a full version as an experiment's candidate), ``progressive``,
``trained_keys``, ``guard`` and ``revert`` (the output guard and its rewind to the last good
delta))."""

from training.follow.trainer import FollowTrainer, follow
from training.follow.types import FollowResult

__all__ = ["FollowResult", "FollowTrainer", "follow"]
