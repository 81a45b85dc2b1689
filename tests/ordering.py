"""The order the suite's modules are handed out in: longest first, by the seconds their tests took
in the last run (pytest's cache, ``.pytest_cache``).

``make test`` runs each suite with ``--dist loadscope --no-loadscope-reorder``: a module's tests on
one worker, the modules handed out in collection order. This plugin makes that order the longest
processing time first rule (LPT): each module's cost is the sum of its tests' last durations (setup,
call and teardown), a test not timed yet counting as the slowest one timed (a new module may be
long: it goes first, where a short one costs nothing); ties keep the larger module first. The last
modules handed out are then the shortest, so neither worker runs a long one alone at the end while
the other waits (xdist's own reorder, by the number of tests, put single-test benches of three
minutes last). With no durations cached (a fresh clone) modules go by their number of tests, as
xdist orders them.

The controller reads the cache once and hands that copy to each xdist worker (``workerinput``), so
every worker collects the same order even when another session in this checkout writes the cache
meanwhile; it records every test's duration as its reports arrive and merges them into the cache at
the end of the session. Workers never write it.
"""

from __future__ import annotations

import pytest

KEY = "recserve/durations"
"""Cache key: test id -> seconds (setup + call + teardown) in the last run that ran it."""


class Ordering:
    """The pytest plugin: orders the collection, records the durations."""

    def __init__(self, config: pytest.Config) -> None:
        self.cache = getattr(config, "cache", None)  # absent under -p no:cacheprovider
        workerinput = getattr(config, "workerinput", None)  # an xdist worker: its controller's copy
        self.worker = workerinput is not None
        self.last = workerinput.get(KEY, {}) if workerinput is not None else self.cached()
        self.seconds: dict[str, float] = {}

    def cached(self) -> dict[str, float]:
        return self.cache.get(KEY, {}) if self.cache is not None else {}

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node) -> None:
        """xdist's controller, as it starts each worker: the durations it read, for the worker's order."""
        node.workerinput[KEY] = self.last

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        seconds = self.last
        modules: dict[str, list[pytest.Item]] = {}
        for item in items:
            modules.setdefault(item.nodeid.split("::")[0], []).append(item)
        unknown = max(seconds.values(), default=0.0)

        def cost(tests: list[pytest.Item]) -> tuple[float, int]:
            return sum(seconds.get(t.nodeid, unknown) for t in tests), len(tests)

        items[:] = [t for tests in sorted(modules.values(), key=cost, reverse=True) for t in tests]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not self.worker:
            self.seconds[report.nodeid] = self.seconds.get(report.nodeid, 0.0) + report.duration

    def pytest_sessionfinish(self) -> None:
        if self.cache is not None and not self.worker and self.seconds:
            self.cache.set(KEY, {**self.cached(), **{k: round(v, 2) for k, v in self.seconds.items()}})
