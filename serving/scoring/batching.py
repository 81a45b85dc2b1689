"""Micro-batching of the request loop's dense stage, on an asyncio event loop (the lean frontend,
``recserve serve --batch-wait-ms``): requests that queue run the dense model together
(``serving.scoring.loop.complete``), each getting the Outcome it gets alone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from serving.scoring.loop import Outcome, Pending, complete


class DenseBatcher:
    """Micro-batches of the dense stage, on the event loop (``ServeConfig.batch_wait_ms``).

    A prediction request counts as in progress from its start (``begin``) until its lookups are
    done and it joins the pending run (``dense``) or it leaves without one (``end``: refused,
    failed). The pending run starts at once when no other request is in progress -- a request
    alone never waits -- or when it holds ``max_items`` items, else ``wait_s`` after its first
    request joined; a request that would take it past ``max_items`` goes into the next run.
    Requests of different scorers (versions) run apart; each gets its own scores, in its item
    order, and the Outcome ``loop.run`` would give it."""

    def __init__(self, wait_s: float, max_items: int, observe: Callable[[int], object] = lambda _: None):
        """``observe``: of the requests per run (the frontend's histogram)."""
        self.observe = observe
        self.wait_s = wait_s
        self.max_items = max_items
        self.in_progress = 0
        self._pending: list[tuple[Pending, asyncio.Future[Outcome]]] = []
        self._items = 0
        self._timer: asyncio.TimerHandle | None = None

    def begin(self) -> None:
        self.in_progress += 1

    def end(self) -> None:
        self.in_progress -= 1
        self._maybe_run()

    async def dense(self, pending: Pending) -> Outcome:
        """The Outcome of a looked-up request, after its micro-batch's dense run."""
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self.in_progress -= 1
        if self._pending and self._items + pending.items > self.max_items:
            self._run()  # the run so far, before this request would take it past max_items
        self._pending.append((pending, future))
        self._items += pending.items
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
        groups: dict[int, list[tuple[Pending, asyncio.Future[Outcome]]]] = {}
        for entry in pending:
            groups.setdefault(id(entry[0].scorer), []).append(entry)
        for group in groups.values():
            try:
                outcomes = complete([p for p, _ in group])
                self.observe(len(group))
                for (_, future), outcome in zip(group, outcomes, strict=True):
                    if not future.done():  # its client may have gone
                        future.set_result(outcome)
            except BaseException as e:  # no request of the run is left without an answer
                for _, future in group:
                    if not future.done():
                        future.set_exception(e)
                if not isinstance(e, Exception):
                    raise
