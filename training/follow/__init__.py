"""The streaming trainer (``recserve train --follow``): it trains the served version from files or a
stream of samples and cuts deltas into it. The nouns are in ``types``; the work is in the modules
beside it (``trainer``, ``steps``, ``book``, ``ranks``, ``cut`` (the one delta cut: ``DeltaCut``,
``DeltaWriter``), ``standby``, ``tables``, ``full_version``,
``progressive``, ``trained_keys``)."""

from training.follow.trainer import FollowTrainer, follow
from training.follow.types import FollowResult

__all__ = ["FollowResult", "FollowTrainer", "follow"]
