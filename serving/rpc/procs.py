"""Starting and stopping the local stack's processes: free ports, spawn with logs, gRPC health
waits, and stopping exactly the processes we started (by pid + process group, never by name).
``proc_stat`` is the one reader of ``/proc/<pid>/stat`` (identity, liveness, CPU time, RSS);
``usable_cpus`` how many CPUs this process may use (``recserve serve --workers auto``)."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from serving.rpc.tls import ClientTLS


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free on ``host`` right now."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def spawn(
    role_args: list[str], log_path: Path, env: dict[str, str] | None = None, die_with_parent: bool = False
) -> subprocess.Popen[bytes]:
    """Run ``recserve <role_args>`` as a child in its own session, output to ``log_path``.
    ``die_with_parent``: the kernel sends it SIGTERM when the thread that started it ends, also
    when that process is SIGKILLed (Linux ``PR_SET_PDEATHSIG``): a trainer killed mid-run (and
    restarted by torchrun) leaves no PS shard behind."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "recserve", *role_args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a terminal's Ctrl-C does not reach it
            env={**os.environ, **(env or {})},
            preexec_fn=_term_with_parent() if die_with_parent and sys.platform == "linux" else None,
        )


def _term_with_parent() -> Callable[[], object]:
    """What the child runs before exec: prctl(PR_SET_PDEATHSIG, SIGTERM), resolved here in the
    parent (the child only calls it: no import after fork)."""
    import ctypes
    import functools

    return functools.partial(ctypes.CDLL(None, use_errno=True).prctl, 1, int(signal.SIGTERM))


def usable_cpus(fs: Path = Path("/sys/fs/cgroup"), own: Path = Path("/proc/self/cgroup")) -> int:
    """The CPUs this process may use: those it may run on (its affinity), capped by the CPU time
    its cgroups allow (a container's CPU limit; a fraction rounds up). A pod on a large node runs
    on all of its CPUs unless the kubelet pins it, but its CPU limit holds."""
    n = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit(fs, own)
    return n if limit is None else max(1, min(n, math.ceil(limit)))


def cgroup_cpu_limit(fs: Path, own: Path) -> float | None:
    """The least CPU limit, in CPUs, of this process's cgroup (as ``own`` lists it, under ``fs``)
    and its ancestors: cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``;
    None when none is set or the files cannot be read."""
    try:
        lines = own.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers and "cpu" not in controllers.split(","):
            continue
        base = fs / "cpu" if controllers else fs  # v1: the cpu hierarchy's mount; v2: the unified one
        here = base / path.lstrip("/")
        for d in (here, *here.parents[: len(here.parts) - len(base.parts)]):
            try:
                if controllers:
                    quota, period = (
                        int((d / f).read_text()) for f in ("cpu.cfs_quota_us", "cpu.cfs_period_us")
                    )
                else:
                    quota_s, period_s = (d / "cpu.max").read_text().split()
                    quota, period = (-1 if quota_s == "max" else int(quota_s)), int(period_s)
            except (OSError, ValueError):
                continue
            if quota > 0 and period > 0:
                limits.append(quota / period)
    return min(limits, default=None)


def term_with_parent() -> None:
    """This process gets SIGTERM when its parent's thread that started it ends (Linux; elsewhere
    nothing): for a child started without ``spawn`` (multiprocessing's)."""
    if sys.platform == "linux":
        _term_with_parent()()


def wait_grpc_healthy(
    address: str,
    timeout_s: float,
    proc: subprocess.Popen[bytes] | None = None,
    log: Path | None = None,
    tls: ClientTLS | None = None,
) -> None:
    """Block until the grpc.health.v1 service at ``address`` answers SERVING (the child ``proc``
    exiting first is a RuntimeError with its log's tail); ``tls``: a ``serving.rpc.tls.ClientTLS``."""
    from serving.rpc.health import wait_serving

    try:
        wait_serving(address, timeout_s, proc=proc, log_path=log, tls=tls)
    except (TimeoutError, RuntimeError) as e:
        raise type(e)(f"{address}: {e}") from None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running(pid: int, started: int | None = None) -> bool:
    """Whether ``pid`` runs (not gone, not a zombie) and, when ``started`` (its recorded
    ``start_time``) is given, is still the process started then, not a recycled pid."""
    if not alive(pid) or _zombie(pid):
        return False
    return started is None or start_time(pid) == started


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass(frozen=True)
class ProcStat:
    """What recserve reads of a process's ``/proc/<pid>/stat`` (proc(5))."""

    state: str
    """R, S, D, Z (a zombie: exited, not yet reaped), ..."""
    ppid: int
    cpu_s: float
    """User + system CPU time so far, in seconds."""
    start_time: int
    """The kernel's start time (clock ticks since boot): with the pid, an identity that a recycled
    pid cannot match."""
    rss_bytes: int
    """Resident set size now (the same counter as VmRSS in /proc/<pid>/status)."""


_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def proc_stat(pid: int) -> ProcStat | None:
    """``pid``'s stat, or None when there is no such process (Linux)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        f = text.rsplit(")", 1)[1].split()  # the command name may hold spaces and parentheses
        return ProcStat(f[0], int(f[1]), (int(f[11]) + int(f[12])) / _TICK, int(f[19]), int(f[21]) * _PAGE)
    except (OSError, IndexError, ValueError):
        return None


def start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (``ProcStat.start_time``), None when it is gone."""
    st = proc_stat(pid)
    return st.start_time if st else None


def stop_pid(pid: int, must_contain: str, timeout_s: float = 15.0, started: int | None = None) -> bool:
    """SIGTERM the process group led by ``pid`` (``pid`` alone when it leads none) -- only if it is
    still the process we started: its start time equals ``started`` (when recorded) or its command
    contains ``must_contain``; a recycled pid is left alone. SIGKILL after ``timeout_s``."""
    return bool(stop_pids([(pid, must_contain, started)], timeout_s))


def _terminate(pid: int) -> tuple[int, bool, int | None] | None:
    """SIGTERM the process group ``pid`` leads, or ``pid`` alone when it leads none; (pid, whether
    it led its group, its start time), or None when it was gone."""
    try:
        started = start_time(pid)
        leads = os.getpgid(pid) == pid
        if leads:
            os.killpg(pid, signal.SIGTERM)
        else:
            os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return None
    return pid, leads, started


def _kill(pid: int, leads: bool, started: int | None) -> None:
    """SIGKILL what is left after SIGTERM: the whole group of a leader -- its members too when the
    leader itself is gone (the group id is not reused while any member lives) -- or a process that
    leads none, only while it is still the process signalled (a recycled pid is left alone)."""
    try:
        if leads:
            os.killpg(pid, signal.SIGKILL)
        elif started is not None and start_time(pid) == started:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_pids(targets: list[tuple[int, str, int | None]], timeout_s: float = 15.0) -> list[int]:
    """``stop_pid`` for many (pid, must_contain, started) at once: SIGTERM every target that is
    still the process we started, all at once, wait for them together, then SIGKILL what is left of
    each (a group's stragglers, e.g. TorchServe's Python workers); returns the pids signalled."""
    signalled = []
    for pid, must_contain, started in targets:
        if not alive(pid):
            continue
        if not ((started is not None and start_time(pid) == started) or must_contain in cmdline(pid)):
            continue
        term = _terminate(pid)
        if term:
            signalled.append(term)
    deadline = time.monotonic() + timeout_s
    waiting = [pid for pid, _, _ in signalled]
    while waiting and time.monotonic() < deadline:
        waiting = [pid for pid in waiting if alive(pid) and not _zombie(pid)]
        if waiting:
            time.sleep(0.05)
    for pid, leads, started in signalled:
        _kill(pid, leads, started)
    return [pid for pid, _, _ in signalled]


def _zombie(pid: int) -> bool:
    st = proc_stat(pid)
    return st is None or st.state == "Z"


def stop_children(procs: list[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> None:
    """Stop child processes this process spawned (each with its process group, all at once) and
    reap them."""
    stop_pids([(p.pid, "recserve", start_time(p.pid)) for p in procs if p.poll() is None], timeout_s)
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def terminate(proc: subprocess.Popen[Any], timeout_s: float = 10.0) -> None:
    """SIGTERM one child (not its group: for a child that shares ours), wait ``timeout_s``, then
    SIGKILL it; reaped either way."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
