"""loadtest/stream_roles.py: a role's metric read off its /metrics, none from a port nobody
answers; a role that exited by itself stops the bench with its log; ready waits on both facts."""

import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from loadtest.stream_roles import LAG_GAUGE, alive, scrape, until_ready
from serving.rpc.procs import free_ports


def test_a_metric_is_read_off_metrics_and_none_where_nobody_answers():
    registry = CollectorRegistry()
    Gauge(LAG_GAUGE, "lag", registry=registry).set(42)
    port, closed = free_ports(2)
    server, thread = start_http_server(port, "127.0.0.1", registry)
    try:
        assert scrape(port, LAG_GAUGE) == 42.0
        assert scrape(port, "recserve_no_such_metric") is None
    finally:
        server.shutdown()
        thread.join(5)
    assert scrape(closed, LAG_GAUGE) is None


def test_a_role_that_exited_by_itself_stops_the_bench_with_its_log(tmp_path):
    (tmp_path / "joiner.log").write_text("starting\nValueError: bad window\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait(30)
    with pytest.raises(
        RuntimeError, match=r"(?s)the joiner exited \(3\) by itself:\n.*ValueError: bad window"
    ):
        alive({"joiner": proc}, tmp_path)
    with pytest.raises(RuntimeError, match="ValueError: bad window"):  # not ready: it died first
        until_ready({"joiner": proc}, tmp_path, free_ports(1)[0], timeout_s=5)
