"""A scoring process follows the model store itself: ``ScorerFollower`` owns the served ``Scorer``.

Both frontends use it: the lean one (``serving.scoring.lean.Frontend``, on its event loop) and
TorchServe's handler (``handlers/recserve_handler.py``, on a thread of its worker) when its
``scoring.json`` names a store to follow instead of a pinned ``version_dir``. One ``step``:

1. the target: the pinned version, or the one CURRENT names (``serving.versions.VersionTarget``);
   nothing to do when it is served already or was refused;
2. the one gate (``model_store.validate`` against the served manifest);
3. a new ``Scorer`` loads beside the serving one -- mapping its co-located shards, warming up
   until every remote shard holds the version, then with the process's recent requests (their
   shapes and rows); in the host's turn, so that the workers of a
   frontend load one at a time while the others serve, with the GIL handed over finely meanwhile
   (``serving.priority.loading_beside_requests``) -- unless an experiment's arm serves that
   version already (a promoted candidate): its scorer is taken over;
4. it replaces the served one in one reference assignment (``on_switch`` is told at once);
5. the replaced scorer keeps its resources ``drain_s`` for requests that took it, then is closed.

A version the gate or the load refuses (a ``ModelStoreError`` or ``ValueError``) is final: logged
and counted once (``recserve_version_refusals_total{component="scorer"}``, ``on_refuse``) and never
tried again; any other failure (a remote shard not holding it yet) is tried again at the next
poll. Serving stays on what it has; while nothing is served, ``not_serving_reason`` says why (the
503's error). Each scorer pins its lookups to its own version and a request (a TorchServe batch)
takes one scorer from start to end, so no response mixes versions.

A step runs at each notice of a new CURRENT (``ScoringConfig.notices``: ``serving.notices``, which
also wake the co-located shards for each delta) and every ``poll_s`` anyway: ``follow`` on an
event loop, ``start`` on a daemon thread. Each step then follows the model's experiment record
(``arms``: ``serving.scoring.experiments.ArmsFollower``, a scorer per arm while one runs), unless
the process is pinned to a version.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import model_store as ms
from serving import memory
from serving.freshness import follow_notices
from serving.notices import AsyncWake, Wake
from serving.priority import loading_beside_requests
from serving.scoring.arms import warm
from serving.scoring.core import Scorer
from serving.scoring.experiments import ArmsFollower
from serving.versions import VersionTarget

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from serving.notices import Notice
    from serving.scoring.arms import Split
    from serving.scoring.config import ScoringConfig

log = logging.getLogger("recserve.serve")
COMPONENT = "scorer"
"""The component label of a scoring process's refusals and notices."""


class ScorerFollower:
    """The ``Scorer`` a scoring process serves of ``model`` in the store at ``store`` (None until a
    version loads), swapped whole at each new version (``pin``: that version only)."""

    def __init__(
        self,
        store: str,
        model: str,
        scoring: ScoringConfig,
        *,
        pin: str = "",
        drain_s: float = 2.0,
        registry: CollectorRegistry | None = None,
    ):
        self.store, self.model, self.scoring, self.drain_s = store, model, scoring, drain_s
        self.scorer: Scorer | None = None
        self.failure = ""  # why the last load of the target version failed (retried)
        self.on_switch: Callable[[Scorer], None] = lambda scorer: None
        """Told of each scorer as it starts serving (the frontend's metrics)."""
        self.on_refuse: Callable[[str, str], None] = lambda version, why: None
        """Told of each version refused for good, with why (besides the log and ``registry``)."""
        self.versions = VersionTarget(store, model, COMPONENT, pin, registry)
        self.notices = follow_notices(scoring.notices, str(Path(store) / model), registry, COMPONENT,
                                      self.colocated)  # fmt: skip
        self.arms = ArmsFollower(
            store, model, scoring, self.notices, drain_s, self.versions.refusals, COMPONENT
        )
        """The running experiment's arms (``arms.split``; None: none runs, or ``pin``)."""
        self._closed = False
        self._wake: Wake | None = None

    @property
    def split(self) -> Split | None:
        """The running experiment as served (``arms.split``): take it once per request."""
        return self.arms.split

    def colocated(self) -> list[tuple[int, Any]]:
        """(shard, follower) of the served scorer's co-located shards (/metrics: serving.freshness;
        ``recserve versions``)."""
        shards = getattr(self.scorer.lookups.worker, "shards", []) if self.scorer is not None else []
        return [(s.shard, s.follower) for s in shards if getattr(s, "local", False)]

    def wants(self, notice: Notice) -> bool:
        """A notice that wakes the follower: a new CURRENT (deltas wake the co-located shards)."""
        return notice.delta_seq < 0 and not self.versions.pin

    def step(self) -> str | None:
        """One poll (blocking: run it off an event loop): load the target version if it is new and
        passes, then serve it; then the experiment's arms. Returns the version switched to, or None."""
        switched = self._step_current()
        if not self.versions.pin and not self._closed:
            self.arms.step(self.scorer)
        return switched

    def _step_current(self) -> str | None:
        target, old = self.versions.target(), self.scorer
        if target is None or not self.versions.wanted(target, old.dense_version if old else None):
            return None
        try:
            ms.validate(self.store, self.model, target, old.manifest if old else None, verify=False)
            vdir = ms.version_dir(self.store, self.model, target)
            # an arm's scorer of that version (a promoted candidate) serves on, not loaded twice
            new = self.arms.take(target) or self._load(vdir)
        except (ms.ModelStoreError, ValueError) as e:  # final: this version will not load as it is
            why = f"version {target} refused: {e}"
            self.versions.refuse(target, why)
            self.on_refuse(target, why)
            return None
        except Exception as e:  # a remote shard not holding it yet, ...: tried again at the next poll
            self.failure = f"version {target} not loaded: {e}"
            log.warning("%s", self.failure)
            return None
        if self._closed:  # shut down while it loaded
            new.close()
            return None
        self.scorer, self.failure = new, ""
        if old is None:  # what the process holds for its life is loaded: out of the collector's scans
            memory.freeze_loaded()
        self.on_switch(new)
        log.info("serving version %s of %s (was %s; lookups %s)", target, self.model,
                 old.dense_version if old else "none", ",".join(new.lookup_modes))  # fmt: skip
        if old is not None:
            time.sleep(self.drain_s)  # requests that took the old scorer finish with it
            if not self.arms.adopt(old):  # an arm of the experiment still serves it
                old.close()
        return target

    def _load(self, vdir: Path) -> Scorer:
        """A scorer of the version at ``vdir``, loaded in the host's turn while requests go on
        (``serving.priority.loading_beside_requests``), then warmed there with the process's recent
        requests (``arms.recent``: its router's; ``serving.scoring.arms.warm``), as a new arm's is:
        its own warm-up runs one-row requests, so the first real ones met a dense runtime that had
        not run their shape, and rows not read yet. Measured in one process, a new co-located ONNX
        scorer's first 200-item request: lookup 1.06-1.15 ms and dense 0.56-0.75 ms, against
        0.6-0.7 and 0.32-0.34 from the fourth on; warmed, 0.6-0.86 and 0.34-0.4."""
        with loading_beside_requests():
            scorer = Scorer(replace(self.scoring, version_dir=str(vdir)), notices=self.notices)
            warm(scorer, self.arms.recent())
            return scorer

    def not_serving_reason(self) -> str:
        return self.versions.not_serving(self.versions.target(), self.failure)

    async def follow(self) -> None:
        """Step at each notice of a new CURRENT and every ``poll_s``, for a process on an event loop."""
        from concurrent.futures import ThreadPoolExecutor

        loop = asyncio.get_running_loop()
        # its own thread: a load blocks for seconds, and the event loop must go on scoring. It runs
        # at normal priority: at nice 10, preempted on a busy host while holding the GIL, it kept
        # the event loop waiting (a new Scorer built three times beside 20-item scoring, two busy
        # processes on the 2 vCPUs: p99 28-43 ms and max 45-180 ms at nice 10, 7.5-23 and 38-48 ms
        # at normal priority)
        loader = ThreadPoolExecutor(1, "serve-follow")
        wake = AsyncWake(self.notices, self.wants)
        try:
            while True:
                try:
                    await loop.run_in_executor(loader, self.step)
                except Exception:  # keep serving what we have; the next poll retries
                    log.exception("follow step failed")
                await wake.wait(self.scoring.poll_s)
        finally:
            wake.close()
            loader.shutdown(wait=False)

    def start(self) -> threading.Thread:
        """Step at each notice of a new CURRENT and every ``poll_s`` on a daemon thread (at normal
        priority, as ``follow``'s loader) until ``close``."""
        self._wake = wake = Wake(self.notices, self.wants)

        def run() -> None:
            try:
                while not self._closed:
                    try:
                        self.step()
                    except Exception:  # keep serving what we have; the next poll retries
                        log.exception("follow step failed")
                    wake.wait(self.scoring.poll_s)
            finally:
                wake.close()

        thread = threading.Thread(target=run, name="recserve-follow", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self._closed = True
        if self._wake is not None:
            self._wake.set()  # the thread's wait ends and it leaves its loop
        self.arms.close()
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None
        if self.notices is not None:
            self.notices.close()
