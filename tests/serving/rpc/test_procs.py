"""serving.rpc.procs: stopping exactly the processes we started, all of them at once; the CPUs a
process may use."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from serving.rpc.procs import proc_stat, running, start_time, stop_children, stop_pid, usable_cpus
from tests.helpers import wait_until

# a child that waits for a signal and ignores none: SIGTERM ends it at once. MARK tells it from
# other processes (not "recserve" alone: a checkout in a folder named recserve puts that in every
# interpreter's path)
MARK = "# recserve test child"
SLEEPER = [sys.executable, "-c", f"import signal; signal.pause()  {MARK}"]


def test_proc_stat_reads_a_childs_parent_cpu_time_rss_and_state():
    # the child holds 200 MB and spends 0.3 s of CPU (stat counts whole clock ticks: >= 0.25 below),
    # then says so and waits for its stdin to close
    code = ("import sys, time\nb = bytearray(200 << 20)\nb[::4096] = b'x' * len(b[::4096])\n"
            "while time.process_time() < 0.3: pass\nprint('ready', flush=True)\nsys.stdin.read()")  # fmt: skip
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        st = proc_stat(child.pid)
        assert st is not None and st.ppid == os.getpid() and st.state in "RS"
        assert st.cpu_s >= 0.25 and st.rss_bytes >= 200 << 20, st
        assert st.start_time == start_time(child.pid)
        assert child.stdin is not None
        child.stdin.close()
        wait_until(
            lambda: (z := proc_stat(child.pid)) is not None and z.state == "Z", 10, "the child a zombie"
        )
    finally:
        child.kill()
        child.wait()
    assert proc_stat(child.pid) is None and start_time(child.pid) is None


def test_stop_children_stops_children_that_lead_no_process_group_at_once():
    procs = [subprocess.Popen(SLEEPER) for _ in range(3)]  # in this process's group, not their own
    t0 = time.monotonic()
    stop_children(procs, timeout_s=10)
    assert all(p.returncode is not None for p in procs)
    assert time.monotonic() - t0 < 5, "each child was waited out instead of signalled"


def test_stop_pid_stops_a_group_leader_and_leaves_a_process_it_did_not_start():
    leader = subprocess.Popen(SLEEPER, start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    try:
        assert not stop_pid(other.pid, MARK, timeout_s=1)  # not ours by its command line
        assert running(other.pid)
        assert stop_pid(leader.pid, MARK, timeout_s=10)
        assert leader.wait(10) is not None
    finally:
        other.kill()
        other.wait()
        leader.kill()
        leader.wait()


def test_a_group_member_that_ignores_sigterm_is_killed_after_its_leader_was_reaped(tmp_path):
    """What `recserve down` meets: the leader (e.g. TorchServe's JVM) exits on SIGTERM and init
    reaps it at once; a member ignoring SIGTERM (a busy Python worker) is still in the group and
    gets the SIGKILL through the group, not lost with the leader's pid."""
    child_pid = tmp_path / "child.pid"
    leader_code = (  # both wait for a signal (signal.pause): the child ignores SIGTERM, the leader not
        "import signal, subprocess, sys\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.pause()'])\n"
        f"open({str(child_pid)!r}, 'w').write(str(child.pid))\n"
        "signal.pause()  # recserve test leader\n"
    )
    leader = subprocess.Popen([sys.executable, "-c", leader_code], start_new_session=True)
    reaper = threading.Thread(target=leader.wait)  # reaps the leader as soon as it exits, as init would
    reaper.start()
    try:
        child = int(wait_until(lambda: child_pid.exists() and child_pid.read_text(), 30, "the child's pid"))
        wait_until(lambda: _ignores_sigterm(child), 30, "the child ignoring SIGTERM")
        assert stop_pid(leader.pid, "recserve test leader", timeout_s=2)
        reaper.join(10)
        wait_until(lambda: not running(child), 10, "the member that ignored SIGTERM killed")
    finally:
        leader.kill()
        reaper.join(10)
        if child_pid.exists() and child_pid.read_text():  # the member too, whatever the test saw
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(child_pid.read_text()), signal.SIGKILL)


def _ignores_sigterm(pid: int) -> bool:
    """SIGTERM is in the process's ignored-signals mask (/proc/<pid>/status SigIgn)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")), 16)
    return bool(mask >> (signal.SIGTERM - 1) & 1)


@pytest.mark.parametrize(
    ("cgroup", "files", "want"),
    [
        ("0::/\n", {"cpu.max": "max 100000"}, 64),  # v2, no limit: the affinity
        (
            "0::/pod/c1\n",
            {"pod/cpu.max": "150000 100000", "pod/c1/cpu.max": "400000 100000"},
            2,
        ),  # the pod's, up
        (
            "1:cpu,cpuacct:/\n0::/\n",
            {"cpu/cpu.cfs_quota_us": "300000", "cpu/cpu.cfs_period_us": "100000"},
            3,
        ),  # v1
        ("1:cpu,cpuacct:/\n", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, 64),
    ],
)
def test_usable_cpus_are_the_affinity_capped_by_the_cgroup_cpu_limit(
    cgroup, files, want, tmp_path, monkeypatch
):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "self-cgroup").write_text(cgroup)
    assert usable_cpus(tmp_path, tmp_path / "self-cgroup") == want
