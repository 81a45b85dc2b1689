"""Micro-batching of the scoring core's dense stage, on an asyncio event loop (the lean frontend,
``recserve serve --batch-wait-ms``): requests that queue run the dense model together, each
getting the reply it gets alone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from serving.scoring.core import Reply, Scorer, Started


class DenseBatcher:
    """Micro-batches of the dense stage, on the event loop (``ServeConfig.batch_wait_ms``).

    A prediction request counts as in progress from its start (``begin``) until its lookups are
    done and it joins the pending run (``dense``) or it leaves without one (``end``: refused,
    failed). The pending run starts at once when no other request is in progress -- a request
    alone never waits -- or when it holds ``max_items`` items, else ``wait_s`` after its first
    request joined; a request that would take it past ``max_items`` goes into the next run.
    Requests of different scorers (versions) run apart; each gets its own logits, in its item
    order, and its reply as ``reply`` would give it."""

    def __init__(
        self,
        wait_s: float,
        max_items: int,
        record: Callable[[Scorer, Reply], Reply] = lambda _, reply: reply,
        observe: Callable[[int], object] = lambda _: None,
    ):
        """``record``: the frontend's count of each reply; ``observe``: of the requests per run."""
        self.record = record
        self.observe = observe
        self.wait_s = wait_s
        self.max_items = max_items
        self.in_progress = 0
        self._pending: list[tuple[Scorer, Started, asyncio.Future]] = []
        self._items = 0
        self._timer: asyncio.TimerHandle | None = None

    def begin(self) -> None:
        self.in_progress += 1

    def end(self) -> None:
        self.in_progress -= 1
        self._maybe_run()

    async def dense(self, scorer: Scorer, started: Started) -> Reply:
        """The reply of a looked-up request, after its micro-batch's dense run."""
        assert started.inputs is not None
        future = asyncio.get_running_loop().create_future()
        self.in_progress -= 1
        if self._pending and self._items + len(started.inputs.pooled) > self.max_items:
            self._run()  # the run so far, before this request would take it past max_items
        self._pending.append((scorer, started, future))
        self._items += len(started.inputs.pooled)
        self._maybe_run()
        return await future

    def _maybe_run(self) -> None:
        if not self._pending:
            return
        if self.in_progress <= 0 or self._items >= self.max_items:
            self._run()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.wait_s, self._run)

    def _run(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        pending, self._pending, self._items = self._pending, [], 0
        groups: dict[int, list[tuple[Scorer, Started, asyncio.Future]]] = {}
        for entry in pending:
            groups.setdefault(id(entry[0]), []).append(entry)
        for group in groups.values():
            scorer = group[0][0]
            try:
                replies = scorer.replies([started for _, started, _ in group])
                self.observe(len(group))
                for (_, _, future), reply in zip(group, replies, strict=True):
                    if not future.done():  # its client may have gone
                        future.set_result(self.record(scorer, reply))
            except BaseException as e:  # no request of the run is left without an answer
                for _, _, future in group:
                    if not future.done():
                        future.set_exception(e)
                if not isinstance(e, Exception):
                    raise
