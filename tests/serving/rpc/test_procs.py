"""serving.rpc.procs: stopping exactly the processes we started, all of them at once."""

from __future__ import annotations

import subprocess
import sys
import time

from serving.rpc.procs import running, stop_children, stop_pid

# a child that ignores nothing: SIGTERM ends it at once
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)  # recserve test child"]


def test_stop_children_stops_children_that_lead_no_process_group_at_once():
    procs = [subprocess.Popen(SLEEPER) for _ in range(3)]  # in this process's group, not their own
    t0 = time.monotonic()
    stop_children(procs, timeout_s=10)
    assert all(p.returncode is not None for p in procs)
    assert time.monotonic() - t0 < 5, "each child was waited out instead of signalled"


def test_stop_pid_stops_a_group_leader_and_leaves_a_process_it_did_not_start():
    leader = subprocess.Popen(SLEEPER, start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert not stop_pid(other.pid, "recserve", timeout_s=1)  # not ours by its command line
        assert running(other.pid)
        assert stop_pid(leader.pid, "recserve", timeout_s=10)
        assert leader.wait(10) is not None
    finally:
        other.kill()
        other.wait()
        leader.kill()
        leader.wait()
