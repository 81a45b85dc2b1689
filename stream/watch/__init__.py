"""``recserve experiment watch``, an experiment's metrics role (issue 56, parts 4 and 5): it reads
the joined samples from the experiment's start, computes every arm's online figures, evaluates the
anytime-valid rule and, with ``--auto``, promotes or aborts through the model store.

- ``config``: ``WatchConfig``, the role's flags;
- ``reader``: ``SampleReader``, the experiment's samples from the samples topic (``Span``,
  ``ReadCounts``);
- ``watcher``: ``Watcher``, the loop: follow the record, feed the figures, look, act;
- ``report``: ``WatchReport``, one look, as /metrics shows it and ``EXPERIMENT.metrics.json``
  holds it (``write_report``, ``read_report``);
- ``metrics``: the /metrics collector and its label design.
"""

from stream.watch.config import WatchConfig
from stream.watch.reader import ReadCounts, SampleReader, Span, WatchError
from stream.watch.report import ReportError, WatchReport, read_report, write_report
from stream.watch.watcher import Watcher

__all__ = [
    "ReadCounts",
    "ReportError",
    "SampleReader",
    "Span",
    "WatchConfig",
    "WatchError",
    "WatchReport",
    "Watcher",
    "read_report",
    "write_report",
]
