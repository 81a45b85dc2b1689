"""The listening gauge and the last notice's lag, collected from a process's ``Notices``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serving.notices.hub import Notices

LISTENING = "recserve_notices_listening"
LAG = "recserve_notice_lag_seconds"


class Listening:
    """``recserve_notices_listening``: 1 while notices sent now are received (a fact to wait on);
    ``recserve_notice_lag_seconds`` {version, seq}: the last notice's seconds from its marker's write
    to its receipt here (the transport's share of a delta's way into lookups)."""

    def __init__(self, notices: Notices):
        self.notices = notices

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        name = self.notices.transport.name
        g = GaugeMetricFamily(LISTENING, "1 while update notices sent now are received", labels=["transport"])
        g.add_metric([name], float(self.notices.listener.listening))
        yield g
        lag = GaugeMetricFamily(LAG, "Seconds from the last notice's marker write to its receipt",
                                labels=["transport", "version", "seq"])  # fmt: skip
        if (last := self.notices.last) is not None:
            lag.add_metric([name, last[0].version, str(last[0].delta_seq)], last[1])
        yield lag
