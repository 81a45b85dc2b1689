"""``recserve serve --workers N`` (serving/scoring/processes.py) as a real process: two workers on
one port both answer, one /metrics sums them (their impression logs too), they share the heap
their parent preloaded, `recserve versions` lists each, a delta reaches every worker, a SIGKILLed
worker is started again and counted while serving goes on, SIGTERM drains them all (exit 0);
connections opened together are spread over both workers; workers that keep dying at start stop
the parent (exit 1); a port another process holds is refused; a bad count is refused by argparse."""

from __future__ import annotations

import http.client
import json
import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

import model_store as ms
from recserve.cli import main
from serving.scoring import roster
from serving.scoring.lean import ServeConfig
from serving.scoring.processes import CrashLoop, Workers, bind
from tests.helpers import free_port, wait_until
from tests.serving.helpers import consume_impressions
from training.follow.cut import DeltaWriter

BODY = json.dumps([{"C1": "68fd1e64", "I1": 1}]).encode()


@pytest.mark.parametrize("value", ["0", "abc", "-2"])
def test_a_bad_worker_count_is_refused_by_argparse(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--workers", value])
    assert exit_.value.code == 2
    assert "argument --workers:" in capsys.readouterr().err


@pytest.mark.slow
def test_workers_that_keep_dying_at_start_stop_the_parent(caplog):
    ctx = multiprocessing.get_context("spawn")
    workers = Workers(2, lambda _slot: (ctx.Process(target=os._exit, args=(3,)), ctx.Event()),
                      crash_loop=CrashLoop(exits=5, window_s=30.0))  # fmt: skip
    with caplog.at_level(logging.ERROR, "recserve.serve"):
        assert workers.run() == 1
    assert "workers keep dying before they serve: 5 exits within 30 s" in caplog.text
    assert "exited with status 3" in caplog.text and workers.restarts == 4


def test_a_port_another_process_listens_on_is_refused_and_port_0_binds_every_socket_to_one():
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as another frontend's worker
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(OSError, match="in use"):
            bind(ServeConfig(host="127.0.0.1", port=other.getsockname()[1]), 2)
    socks = bind(ServeConfig(host="127.0.0.1", port=0), 3)
    try:
        assert len({s.getsockname() for s in socks}) == 1 and socks[0].getsockname()[1] != 0
    finally:
        for s in socks:
            s.close()


def _post(port: int, key: str) -> tuple[int | None, int, dict]:
    """(status, the answering worker's pid, the reply's versions) of one request on a new
    connection (the kernel gives each to a worker's socket); (None, 0, {}) when refused."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/predictions/criteo", BODY, {"Authorization": f"Bearer {key}",
                                                           "Content-Type": "application/json"})  # fmt: skip
        resp = conn.getresponse()
        reply = json.loads(resp.read())
        return resp.status, int(resp.getheader("x-recserve-pid") or 0), reply.get("versions", {})
    except (ConnectionError, http.client.HTTPException):
        return None, 0, {}
    finally:
        conn.close()


def _metrics(port: int) -> dict[str, float]:
    """The frontend's /metrics, sample -> value ({} while nothing listens)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    except ConnectionError:
        return {}
    finally:
        conn.close()
    return {
        k: float(v)
        for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if line[:1] not in ("#", ""))
    }


def _pids_answering(port: int, key: str, n: int) -> set[int]:
    """The pids of the workers answering ``n`` requests (every one a 200)."""
    answers = [_post(port, key) for _ in range(n)]
    assert {status for status, _, _ in answers} == {200}, answers
    return {pid for _, pid, _ in answers}


@pytest.fixture(scope="module")
def frontend(trained, kafka):
    """`recserve serve --workers 2` over the trained store (token auth on), polling every 600 s
    (deltas reach its workers by their notices), logging impressions to a topic of its own."""
    root = trained[0]
    port = free_port()
    topic = kafka.create_topic(f"imps-workers-{port}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "recserve", "serve", "--workers", "2", "--store", str(root), "--port", str(port),
         "--poll-s", "600", "--drain-s", "0.5", "--log-impressions", f"kafka://{kafka.bootstrap}/{topic}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    try:
        wait_until(lambda: _metrics(port).get("recserve_serve_workers") == 2 if proc.poll() is None else True,
                   120, "both workers serving")  # fmt: skip
        assert proc.poll() is None, "".join(log)
        key = json.loads((root / ".run" / "criteo" / "serve-key_file.json").read_text())["inference"]["key"]
        pids = wait_until(
            lambda: len(p := _pids_answering(port, key, 4)) == 2 and p, 60, "both workers answering"
        )
        yield root, port, key, proc, pids, log, (kafka.bootstrap, topic)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
def test_both_workers_answer_and_one_metrics_sums_their_counts(frontend):
    _, port, key, _, pids, _, (bootstrap, topic) = frontend
    before = _metrics(port)
    ok = (
        'recserve_scoring_requests_total{dense_version="1",embedding_version="1",model="criteo",status="200"}'
    )
    answered = [_post(port, key)[1] for _ in range(20)]
    assert set(answered) <= pids
    after = _metrics(port)  # a worker's counts are in its file as it answers
    assert after[ok] - before.get(ok, 0.0) == 20 and after["recserve_serve_workers"] == 2
    assert after["recserve_serve_worker_restarts_total"] == 0
    assert after['recserve_scoring_version{model="criteo",version="1"}'] == 1
    assert after['recserve_notices_listening{transport="inotify"}'] == 1  # every worker listens
    # each worker logs its own impressions; their counts come to /metrics within a second
    logged = f'recserve_impressions_logged_total{{topic="{topic}"}}'
    wait_until(lambda: (m := _metrics(port)).get(logged) == m[ok], 10, "every impression counted as logged")
    consume_impressions(bootstrap, topic, int(after[ok]))


@pytest.mark.slow
def test_connections_opened_together_are_spread_over_both_workers(frontend):
    """A client that keeps its connections (locust's users, a pool) loads the workers as they were
    handed out: one socket each (SO_REUSEPORT), the kernel spreads them by a hash of their ports
    (100 connections to one shared socket went 67/33, 73/27 and 49/51)."""
    _, port, key, _, pids, *_ = frontend
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=10) for _ in range(200)]
    try:
        for conn in conns:
            conn.connect()
        held: dict[int, int] = {}
        for conn in conns:
            conn.request("POST", "/predictions/criteo", BODY, {"Authorization": f"Bearer {key}",
                                                               "Content-Type": "application/json"})  # fmt: skip
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200
            pid = int(resp.getheader("x-recserve-pid") or 0)
            held[pid] = held.get(pid, 0) + 1
    finally:
        for conn in conns:
            conn.close()
    assert set(held) == pids and min(held.values()) >= 70, held  # a fair coin: under 70 of 200 is 1e-5


def _rollup(pid: int) -> dict[str, int]:
    """/proc/<pid>/smaps_rollup: field -> kB."""
    lines = open(f"/proc/{pid}/smaps_rollup").read().splitlines()[1:]
    return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in lines)}


@pytest.mark.slow
def test_the_workers_share_the_heap_their_parent_preloaded(frontend):
    """Forked from a parent that imported torch and numba and loaded the decode kernels, a worker
    shares most of its heap with it and the other worker (a spawned interpreter shares none of it:
    its anonymous pages' PSS equals their RSS)."""
    _, port, key, _, pids, log, _ = frontend
    assert any("preloaded for the workers: " in line and "the decode kernels of version 1's schema" in line
               for line in log), "".join(log)  # fmt: skip
    _pids_answering(port, key, 20)
    for pid in pids:
        rollup = _rollup(pid)
        assert rollup["Pss_Anon"] < 0.7 * rollup["Anonymous"], rollup


@pytest.mark.slow
def test_recserve_versions_lists_every_worker(frontend):
    root, port, _, proc, pids, *_ = frontend

    def listed() -> str:
        out = subprocess.run([sys.executable, "-m", "recserve", "versions", "--store", str(root)],
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        return out if all(f"pid {p} (worker of {proc.pid})  version 1" in out for p in pids) else ""

    out = wait_until(listed, 30, "both workers in `recserve versions`", poll_s=0.5)
    assert f"frontends (`recserve serve`, 2 processes):\n  127.0.0.1:{port}  pid" in out


@pytest.mark.slow
def test_a_delta_is_applied_by_every_worker(frontend):
    root, port, key, _, pids, *_ = frontend
    writer = DeltaWriter(root, "criteo", "1")
    signs = writer.signs()
    writer.assign(signs[:500], np.random.default_rng(0).normal(0, 0.05, (500, writer.dim)))
    seq, _, _ = writer.publish()
    seen: dict[int, int] = {}

    def every_worker_on_it() -> bool:
        for status, pid, versions in (_post(port, key) for _ in range(4)):
            assert status == 200
            seen[pid] = versions["delta_seq"]
        return set(seen) == pids and set(seen.values()) == {seq}

    wait_until(every_worker_on_it, 30, f"every worker's replies naming delta {seq}", poll_s=0.1)


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_counted_while_serving_goes_on(frontend):
    root, port, key, _, pids, *_ = frontend
    seq = max(ms.list_deltas(ms.version_dir(root, "criteo", "1")), default=-1)  # a new worker serves it too
    replies: list[tuple[int | None, int, dict]] = []
    stop = threading.Event()

    def load() -> None:  # one request at a time: at most one is in flight at the kill
        while not stop.is_set():
            replies.append(_post(port, key))

    client = threading.Thread(target=load)
    client.start()
    victim = min(pids)
    try:
        wait_until(lambda: len(replies) >= 5, 30, "requests answered before the kill")
        os.kill(victim, signal.SIGKILL)
        killed_at = len(replies)
        wait_until(
            lambda: _metrics(port).get("recserve_serve_worker_restarts_total") == 1, 30, "the restart counted"
        )
        wait_until(lambda: any(pid not in pids and v.get("delta_seq") == seq for s, pid, v in replies[killed_at:]),
                   60, "the new worker answering, on the latest delta")  # fmt: skip
    finally:
        stop.set()
        client.join(30)
    failed = [r for r in replies if r[0] != 200]
    assert len(failed) <= 1, failed  # the killed worker's request in flight, if it had one
    assert victim not in {pid for status, pid, _ in replies[killed_at + 1 :] if status == 200}
    wait_until(lambda: _metrics(port)["recserve_serve_workers"] == 2, 10, "two workers serving again")


@pytest.mark.slow
def test_sigterm_drains_every_worker_and_exits_0(frontend):
    root, _, _, proc, _, log, _ = frontend
    workers = [r.pid for r in roster.read(roster.roster_dir(root, "criteo"))]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, "".join(log)
    assert any("stopped: every worker drained" in line for line in log)
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert roster.read(roster.roster_dir(root, "criteo")) == []
