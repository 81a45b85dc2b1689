"""The benches' processes: the one process sampler (``usage``, ``Sampler``, ``run_sampled``: RSS
and CPU time from the product's one reader of ``/proc/<pid>/stat``, ``serving.rpc.procs.proc_stat``)
and the one spawn-and-wait (``running``: start, wait with a deadline until ready, stop; recserve
roles through the product's ``spawn``, every process stopped by its ``stop_children``)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loadtest.common import ROOT, Stopwatch
from serving.rpc.procs import proc_stat, spawn, stop_children


# ---- the sampler ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Usage:
    """What a set of processes uses, summed over those still there."""

    cpu_s: float
    """User + system CPU seconds so far."""
    rss_bytes: int
    """Resident memory now."""


def usage(pids: Sequence[int]) -> Usage:
    stats = [s for s in map(proc_stat, pids) if s is not None]
    return Usage(sum(s.cpu_s for s in stats), sum(s.rss_bytes for s in stats))


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (every CPU's user, nice, system, irq and
    softirq time in ``/proc/stat``: every process's, ours and anyone else's)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def pss_bytes(pids: Sequence[int]) -> int:
    """Summed proportional set size of ``pids`` (``/proc/<pid>/smaps_rollup``): each page counted
    once over every process mapping it, so shared libraries are not counted once per process as
    summed RSS counts them. 0 for a process that is gone."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
    return total


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), found by their parent pids."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (st := proc_stat(int(d))) is not None:
            kids.setdefault(st.ppid, []).append(int(d))
    out, todo = [], list(kids.get(pid, []))
    while todo:
        out.append(p := todo.pop())
        todo += kids.get(p, [])
    return out


def tree(pid: int) -> Callable[[], list[int]]:
    """``pid`` and its descendants as they are at each call (for ``Sampler``)."""
    return lambda: [pid, *descendants(pid)]


class Sampler(threading.Thread):
    """Samples ``usage`` of the processes ``pids`` (a list, or a callable asked at each sample)
    every ``interval_s`` from start until stop: ``samples`` holds (time.time(), Usage)."""

    def __init__(self, pids: Sequence[int] | Callable[[], Sequence[int]], interval_s: float = 0.2):
        super().__init__(name="sampler", daemon=True)
        self.pids = pids if callable(pids) else (lambda: pids)
        self.interval_s = interval_s
        self.samples: list[tuple[float, Usage]] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while True:
            self.samples.append((time.time(), usage(self.pids())))
            if self._stop_event.wait(self.interval_s):
                return

    def stop(self) -> None:
        self._stop_event.set()
        self.join()

    def __enter__(self) -> Sampler:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def peak_rss(self, windows: Sequence[tuple[float, float]] = ((-np.inf, np.inf),)) -> int:
        """The highest RSS sampled inside any of ``windows`` (time.time() pairs); 0 when none."""
        return max((u.rss_bytes for t, u in self.samples if any(a <= t <= b for a, b in windows)), default=0)


@dataclass(frozen=True)
class Finished:
    """A command run to its end by ``run_sampled``."""

    stdout: str
    wall_s: float
    peak_rss: int
    """The process and its descendants (PS shards a trainer started), sampled."""
    own_peak_rss: int
    """The process alone: the kernel's high-water mark (wait4's ru_maxrss), exact."""


def run_sampled(cmd: list[str], timeout_s: float, interval_s: float = 0.2) -> Finished:
    """Run ``cmd`` (from the checkout's root) to its end, sampling its process tree's memory; a
    non-zero exit is a RuntimeError with its stderr's tail, running past ``timeout_s`` a
    TimeoutError (the process group killed)."""
    out: list[str] = []
    err: list[str] = []
    with Stopwatch() as sw:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # fmt: skip
        readers = [threading.Thread(target=lambda f=f, b=b: b.append(f.read())) for f, b in
                   ((proc.stdout, out), (proc.stderr, err))]  # fmt: skip
        for r in readers:
            r.start()
        late = threading.Event()

        def stop() -> None:
            late.set()
            stop_children([proc], 5.0)  # type: ignore[list-item]  # (a text-mode Popen)

        timer = threading.Timer(timeout_s, stop)
        timer.start()
        with Sampler(tree(proc.pid), interval_s) as sampled:
            _, status, rusage = os.wait4(proc.pid, 0)
        timer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        for r in readers:
            r.join()
    if late.is_set():
        raise TimeoutError(f"{' '.join(cmd)}: still running after {timeout_s} s")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{''.join(err)[-3000:]}")
    return Finished("".join(out), sw.s, sampled.peak_rss(), rusage.ru_maxrss * 1024)  # KiB on Linux


# ---- the spawn-and-wait --------------------------------------------------------------------------
def log_excerpt(log: Path, tail: int = 3000) -> str:
    """A dead child's log for an error: its first line naming an error (a C++ stack trace buries
    CUDA's own message far above the tail), then the tail."""
    text = log.read_text(errors="replace")
    first = next((line for line in text.splitlines() if "Error" in line or "error:" in line), "")
    shown = text[-tail:]
    return f"{first}\n...\n{shown}" if first and first not in shown else shown


def wait_for(
    predicate: Callable[[], object],
    timeout_s: float,
    what: str,
    procs: Sequence[tuple[str, subprocess.Popen, Path]] = (),
    poll_s: float = 0.1,
) -> float:
    """Poll ``predicate`` until it is true; returns when (time.time()). Not true within
    ``timeout_s``: a TimeoutError naming ``what``, with the log tail of each of ``procs`` that
    ``what`` names; one of ``procs`` (name, Popen, log path) exiting first: a RuntimeError with its
    log's tail."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        for name, proc, log in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode}: {log_excerpt(Path(log))}")
        if time.monotonic() > deadline:
            logs = "".join(f"\n{name}'s log:\n{log_excerpt(Path(log), 1500)}" for name, _, log in procs
                           if name in what and Path(log).exists())  # fmt: skip
            raise TimeoutError(f"not {what} after {timeout_s}s{logs}")
        time.sleep(poll_s)
    return time.time()


@contextlib.contextmanager
def running(
    cmd: list[str],
    log: Path,
    ready: Callable[[], object],
    what: str,
    timeout_s: float = 120.0,
    env: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen]:
    """Start ``cmd`` in its own process group, output to ``log`` (``recserve ...``: the product's
    ``spawn``), wait until ``ready()`` (``wait_for``: its exit first is an error with the log's
    tail), yield it; stop it and its group on the way out (``stop_children``), also on error."""
    if cmd[0] == "recserve":
        proc = spawn(cmd[1:], log, env)
    else:
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True, env={**os.environ, **(env or {})})  # fmt: skip
    try:
        wait_for(ready, timeout_s, what, [(cmd[0], proc, log)])
        yield proc
    finally:
        stop_children([proc])


def grpc_serving(address: str, timeout_s: float = 1.0) -> Callable[[], bool]:
    """A ``ready`` for ``running``: the grpc.health.v1 service at ``address`` answers SERVING
    within ``timeout_s``."""

    def ready() -> bool:
        import grpc

        from serving.rpc.health import check

        with grpc.insecure_channel(address) as ch:
            return check(ch, timeout_s=timeout_s) == "SERVING"

    return ready


def http_ok(url: str) -> Callable[[], bool]:
    """A ``ready`` for ``running``: GET ``url`` answers 200."""

    def ready() -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    return ready


def venv_env() -> dict:
    """This process's environment with its interpreter's bin directory (the venv: ``recserve``,
    ``torchrun``) first on PATH, for roles started on a namespace host."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
