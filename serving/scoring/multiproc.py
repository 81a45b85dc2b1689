"""One ``/metrics`` for a frontend of several processes (``recserve serve --workers N``).

A scoring process has two kinds of metric, and each crosses processes its own way:

- metric objects (``prometheus_client``'s Counter, Gauge, Histogram: requests, stage times, the
  served version, ...) keep their values in files under the frontend's own directory, one set per
  process (Prometheus's multiprocess mode: ``PROMETHEUS_MULTIPROC_DIR``, set by the parent before
  it starts a worker). Counters and histograms are summed over every process that served, a dead
  worker's included (the sum never goes back); the frontend's gauges are ``GAUGE_MODE``: the
  greatest value among live workers (1 for a version while any worker serves it), and ``reset``
  zeroes a gauge's old children, which a file would keep (a version served before shows 0);
- collectors that read a process's state when scraped (the impression log's counts, the shadow
  arms' drops, delta visibility, notices: ``serving.freshness``, ``serving.notices``) have no
  files: each worker writes what they collect to ``collected-<pid>.json`` every ``SNAPSHOT_S``
  (``Snapshots``), and the worker that answers adds its own, collected live, to the others' files.
  Counters are summed over every process (the parent renames a dead worker's file
  ``dead-<pid>.json``: its counts stay); gauges are merged over live processes per label set:
  the least for ``LEAST`` (``recserve_notices_listening`` is 1 only while every worker listens),
  else the greatest.

The parent's own metrics (``recserve_serve_workers``, ``recserve_serve_worker_restarts_total``) are
a collected file of its pid (``write_collected``).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from serving.notices.metrics import LISTENING

if TYPE_CHECKING:
    from prometheus_client import Gauge
    from prometheus_client.metrics_core import Metric

ENV = "PROMETHEUS_MULTIPROC_DIR"
GAUGE_MODE: Final = "livemax"
"""How the frontend's gauges combine over its workers (``prometheus_client`` multiprocess mode)."""
SNAPSHOT_S = 1.0
"""How often a worker writes its collected families (how stale another worker's are at a scrape)."""
LEAST = frozenset({LISTENING})
"""Gauges whose frontend value is the least over the workers (the others: the greatest)."""
FORMAT = "recserve.collected/1"
WORKERS = "recserve_serve_workers"
RESTARTS = "recserve_serve_worker_restarts"


def reset(gauge: Gauge) -> None:
    """``gauge.clear()``; in multiprocess mode, where a cleared child's last value would stay in
    this process's file, every child is set to 0 instead."""
    if ENV not in os.environ:
        gauge.clear()
        return
    for family in gauge.collect():
        for sample in family.samples:
            gauge.labels(**sample.labels).set(0)


class WorkerRegistry(CollectorRegistry):
    """A worker's registry: it keeps the collectors that are not metric objects apart, to snapshot."""

    def __init__(self) -> None:
        super().__init__()
        self.collected: list[Any] = []

    def register(self, collector: Any) -> None:
        super().register(collector)
        if not isinstance(collector, MetricWrapperBase):
            self.collected.append(collector)

    def collect_own(self) -> list[Metric]:
        """What those collectors collect now."""
        return [family for c in self.collected for family in c.collect()]


def write_collected(directory: str | Path, families: Iterable[Metric], pid: int | None = None) -> None:
    """``families`` as this process's (``pid``'s) collected file, replaced whole."""
    path = Path(directory) / f"collected-{pid or os.getpid()}.json"
    record = {"format": FORMAT, "families": [
        {"name": f.name, "type": f.type, "help": f.documentation,
         "samples": [[s.name, s.labels, s.value] for s in f.samples]} for f in families]}  # fmt: skip
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def read_collected(path: Path) -> list[Metric]:
    """The families of a collected file; another format is refused by name."""
    from prometheus_client.metrics_core import Metric

    record = json.loads(path.read_text())
    if record.get("format") != FORMAT:
        raise ValueError(f"{path}: format {record.get('format')!r}, not {FORMAT}")
    out = []
    for f in record["families"]:
        family = Metric(f["name"], f["help"], f["type"])
        for name, labels, value in f["samples"]:
            family.add_sample(name, labels, value)
        out.append(family)
    return out


def merge(live: list[list[Metric]], dead: list[list[Metric]]) -> list[Metric]:
    """One family per name: counters summed over ``live`` and ``dead`` processes, gauges of the
    live ones the greatest (``LEAST``: the least) per label set; ``_created`` samples dropped."""
    from prometheus_client.metrics_core import Metric

    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[Any, ...], float]] = {}
    for processes, alive in ((live, True), (dead, False)):
        for f in (f for families_ in processes for f in families_):
            if f.type == "gauge" and not alive:
                continue
            families.setdefault(f.name, Metric(f.name, f.documentation, f.type))
            into = values.setdefault(f.name, {})
            pick = min if f.name in LEAST else max
            for s in f.samples:
                if s.name.endswith("_created"):
                    continue
                key = (s.name, tuple(sorted(s.labels.items())))
                old = into.get(key)
                into[key] = (
                    s.value if old is None else (old + s.value if f.type != "gauge" else pick(old, s.value))
                )
    for name, family in families.items():
        for (sample, labels), value in values[name].items():
            family.add_sample(sample, dict(labels), value)
    return list(families.values())


class Collected:
    """The whole frontend's collected families: this process's, collected live (``own``), and every
    other process's file in ``directory``."""

    def __init__(self, directory: str | Path, own: Callable[[], list[Metric]]):
        self.directory, self.own = Path(directory), own

    def collect(self) -> list[Metric]:
        live = [self.own()]
        dead: list[list[Metric]] = []
        for name in os.listdir(self.directory):
            pid = name.removeprefix("collected-").removeprefix("dead-").removesuffix(".json")
            if not name.endswith(".json") or not pid.isdigit() or int(pid) == os.getpid():
                continue
            for kind, into in (("collected", live), ("dead", dead)):  # renamed since the listing: dead
                try:
                    into.append(read_collected(self.directory / f"{kind}-{pid}.json"))
                    break
                except FileNotFoundError:
                    continue
        return merge(live, dead)


def use_files() -> None:
    """Metric objects made from now on keep their values in ``$PROMETHEUS_MULTIPROC_DIR``'s files.
    ``prometheus_client`` chooses that once, when it is imported: a worker forked from a parent
    that imported it before setting the directory would otherwise keep its values to itself."""
    from prometheus_client import values

    values.ValueClass = values.get_value_class()  # type: ignore[no-untyped-call]


def frontend_registry(directory: str | Path, own: Callable[[], list[Metric]]) -> CollectorRegistry:
    """What a worker's ``/metrics`` answers: every process's metric objects and collected families."""
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]
    registry.register(Collected(directory, own))
    return registry


def mark_dead(directory: str | Path, pid: int) -> None:
    """A worker ``pid`` exited: its live gauges leave, its counts stay (called by the parent)."""
    from prometheus_client import multiprocess

    multiprocess.mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]
    try:
        os.replace(Path(directory) / f"collected-{pid}.json", Path(directory) / f"dead-{pid}.json")
    except FileNotFoundError:  # it died before its first snapshot
        pass


def parent_families(serving: int, restarts: int) -> list[Metric]:
    """The parent's metrics: the workers serving now and the restarts so far."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    return [
        GaugeMetricFamily(WORKERS, "Worker processes of this frontend taking connections", value=serving),
        CounterMetricFamily(RESTARTS, "Worker processes started again after one exited", value=restarts),
    ]


class Snapshots:
    """Writes ``collect()`` as this process's collected file every ``every_s`` on a daemon thread,
    and once more at ``close``."""

    def __init__(
        self, directory: str | Path, collect: Callable[[], list[Metric]], every_s: float = SNAPSHOT_S
    ):
        self.directory, self.collect = directory, collect
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(every_s,), name="recserve-snapshots", daemon=True
        )
        self._thread.start()

    def _run(self, every_s: float) -> None:
        while True:
            write_collected(self.directory, self.collect())
            if self._stop.wait(every_s):
                return

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        write_collected(self.directory, self.collect())
