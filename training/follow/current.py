"""Which version a continuous trainer trains into next: ``CurrentWatch``, the model's CURRENT as the
trainer reads it.

CURRENT moves when an operator publishes (``recserve publish``, ``recserve train --publish``), when
a full version from the stream is published or a canary promoted. The trainer moves with it, the
last delta into the old version first (``FollowTrainer``), unless the serving PS would refuse the
new version (the one gate, ``model_store.validate``, against the manifest of the version followed)
or it cannot be loaded: then it stays on the old one, and the refusal is remembered, so a version
is judged once. A stream's looks come a step apart: it reads CURRENT once a ``--poll-s``.

Under torchrun rank 0 reads CURRENT and every rank moves at the look where it says so
(``training.follow.ranks``). No rank may refuse then, or the ranks would part: rank 0 checks every
file of the version first (``verify``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import model_store as ms

if TYPE_CHECKING:
    from training.follow.types import Loaded

log = logging.getLogger("recserve.train.follow")

REFUSALS = (ms.ModelStoreError, OSError, ValueError)
"""What a version that cannot be followed raises: refused, not a failure of the trainer."""


class CurrentWatch:
    def __init__(self, store: str, model: str, poll_s: float, clock: Callable[[], float] = time.monotonic):
        self.store, self.model, self.poll_s, self.clock = store, model, poll_s, clock
        self.refused: set[str] = set()
        """Versions CURRENT named that could not be followed."""
        self._read = float("-inf")  # when ``due`` last said yes

    def first(self) -> str:
        """The version CURRENT names (a model with nothing published is an error)."""
        version = ms.current(self.store, self.model)
        if version is None:
            raise ms.ModelStoreError(f"{self.model}: nothing published under {self.store}")
        return version

    def due(self) -> bool:
        """Whether a ``poll_s`` passed since the last time this said so (the first time: yes)."""
        now = self.clock()
        if now < self._read + self.poll_s:
            return False
        self._read = now
        return True

    def moved(self, followed: Loaded, verify: bool = False) -> str | None:
        """The version CURRENT names when it is another than ``followed`` and the gate lets it
        replace it (``verify``: every file's checksum too), else None."""
        version = self.first()
        if version == followed.version or version in self.refused:
            return None
        try:
            ms.validate(self.store, self.model, version, followed.manifest, verify=verify)
        except REFUSALS as e:
            self.refuse(version, followed.version, e)
            return None
        return version

    def proposed(self, rank: int, followed: Loaded | None) -> str | None:
        """Rank ``rank``'s vote at a look (``training.follow.ranks``): rank 0's, once a ``poll_s``,
        a new version for every rank to move to, each of its files checked first."""
        if rank != 0 or followed is None or not self.due():
            return None
        return self.moved(followed, verify=True)

    def refuse(self, version: str, followed: str, error: Exception) -> None:
        log.error("CURRENT moved to %s, which cannot be loaded (%s): staying on %s", version, error, followed)
        self.refused.add(version)
