"""loadtest/stream_roles.py: a role's metric read off its /metrics, none from a port nobody
answers; a role that exited by itself stops the bench with its log; ready waits on both facts; a
killed trainer's standby becomes the trainer and a new standby takes the dead one's port; the
output guard's warmup follows the traffic."""

import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from loadtest import stream_roles
from loadtest.stream_roles import (
    LAG_GAUGE,
    STANDBY,
    alive,
    guard_warmup,
    input_guard_warmup,
    scrape,
    until_ready,
)
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
        until_ready({"trainer": ["train", "--metrics-port", str(free_ports(1)[0])]}, {"joiner": proc}, tmp_path,
                    timeout_s=5)  # fmt: skip


def test_a_killed_trainer_s_standby_trains_on_and_a_new_standby_starts(tmp_path, monkeypatch):
    started = []

    def spawn(argv, log):  # a process of its own session, as serving.rpc.procs.spawn starts them
        started.append((argv, log))
        return subprocess.Popen(["sleep", "60"], start_new_session=True)

    monkeypatch.setattr(stream_roles, "spawn", spawn)
    roles = stream_roles.trainer_roles(["train", "--follow", "m"], [1001, 1002], standby=True)
    assert roles == {"trainer": ["train", "--follow", "m", "--metrics-port", "1001"],
                     STANDBY: ["train", "--follow", "m", "--metrics-port", "1002"]}  # fmt: skip
    procs: dict = {}
    try:
        for name in ("trainer", STANDBY):
            stream_roles.start(roles, procs, tmp_path, name)
        first, second = procs["trainer"], procs[STANDBY]
        stream_roles.kill(roles, procs, tmp_path, "trainer")
        assert first.returncode == -9 and procs["trainer"] is second and procs[STANDBY].poll() is None
        assert stream_roles.port_of(roles["trainer"]) == 1002 and started[-1] == (
            roles[STANDBY],
            tmp_path / "trainer.log",
        )
        assert stream_roles.port_of(roles[STANDBY]) == 1001
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_the_guards_warmup_covers_two_join_windows_of_samples():
    assert guard_warmup(10.0, 10_000.0) == ["--guard-warmup-windows", "100"]  # 200,000 samples
    assert guard_warmup(4.0, 800.0) == ["--guard-warmup-windows", "5"]  # never under the default


def test_the_joiners_input_guard_warms_up_over_two_join_windows_of_items():
    assert input_guard_warmup(10.0, 12_000.0) == ["--guard-warmup-items", "240000"]
    assert input_guard_warmup(4.0, 120.0) == ["--guard-warmup-items", "5000"]  # never under the default
