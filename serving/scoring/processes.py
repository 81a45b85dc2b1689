"""``recserve serve --workers N``: one port, N processes serving it, and the parent that keeps them.

The parent binds the port (``--host``, ``--port``) once per worker (``SO_REUSEPORT``: one
listening socket a worker), loads what every worker holds alike (torch, numba and the kernels a
decode runs, the scoring modules: ``serving.scoring.preload``) and forks N workers from itself
(multiprocessing's fork), so they share those pages copy-on-write instead of each holding a copy;
worker i inherits socket i. A worker is the one-process frontend (``serving.scoring.lean``) on it,
so it maps its co-located shards itself (the page cache holds their files once), follows the
notices and the poll and applies deltas, logs its own impressions, serves experiments, with the
same key file and TLS. The kernel spreads new connections over the listening sockets by a hash of
each connection's addresses and ports, so each worker gets its share. One socket that every worker
accepts from (what this did first, and uvicorn's and gunicorn's way) gave a connection to whichever
woke first: of 100 connections opened one after the other, 67, 73 and 49 went to one of two
workers, and a client that keeps its connections open (locust's users, a load balancer's pool)
then loads one worker up to twice the other: ``--workers 2`` held 1.4x the rate of one where the
busier worker met the latency bound (bench-e2e, stop 66). A worker restarted takes over its
slot's socket: the connections the kernel queued on it while no worker held it wait for the new
one instead of being refused. Then the parent waits on its workers (``Workers.run``):

Readiness: a worker finishes its first look at the store (CURRENT's version loaded, or why not
known) before it accepts (``asgi.FrontendProcess``). Until the first worker does, the port refuses
connections (nothing listens on it yet); from then on every connection reaches a worker that has
looked, so ``/ping`` is 200 as soon as one worker serves a version and a worker restarted later
joins loaded. A worker dies with its parent (``PR_SET_PDEATHSIG``): it never holds the port alone.

uvicorn's own ``supervisors.Multiprocess`` hands out the bound socket the same way, but restarts
a dead worker uncounted, stops only on one exit code (startup failure), and judges a worker alive
by a pipe ping answered within 5 s, which a worker still importing torch on a busy host misses (it
is killed as hung); so the parent here waits on the workers' process sentinels instead.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from serving.scoring import multiproc, roster
from serving.scoring.preload import preload

if TYPE_CHECKING:
    from serving.scoring.lean import ServeConfig

log = logging.getLogger("recserve.serve")
LOG_FORMAT = "%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s"
STOP_GRACE_S = 30.0
"""How long a draining worker may take past ``--drain-s`` (closing its scorers, flushing its
impressions) before it is killed."""


@dataclass(frozen=True)
class CrashLoop:
    """When workers keep dying as they start: ``exits`` exits of workers not yet serving within
    ``window_s``."""

    exits: int = 5
    window_s: float = 30.0


def how(exitcode: int | None) -> str:
    """How a process ended, in words."""
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exited with status {exitcode}"


class Workers:
    """``n`` worker processes made by ``make(slot)`` (an unstarted process and the event it sets
    once it takes connections; ``slot`` 0 to n - 1, the same for a restart), each started again
    when it exits, until ``stop`` or a crash loop. ``on_exit(pid)`` is told of each exit;
    ``on_change(serving, restarts)`` of each change."""

    def __init__(self, n: int, make: Callable[[int], tuple[BaseProcess, Any]], *, drain_s: float = 2.0,
                 crash_loop: CrashLoop = CrashLoop(), on_exit: Callable[[int], None] = lambda pid: None,
                 on_change: Callable[[int, int], None] = lambda serving, restarts: None):  # fmt: skip
        self.n, self.make, self.drain_s, self.crash_loop = n, make, drain_s, crash_loop
        self.on_exit, self.on_change = on_exit, on_change
        self.slots: list[tuple[BaseProcess, Any]] = []
        self.restarts = 0
        self.stopping = False
        self._failed_starts: collections.deque[float] = collections.deque()
        self._shown = (-1, -1)

    def stop(self, *_: Any) -> None:
        """Drain every worker and return (a signal handler)."""
        self.stopping = True

    def run(self, poll_s: float = 0.2) -> int:
        """Keep the workers running until ``stop`` (0) or a crash loop (1); they are drained then."""
        try:
            self.slots = [self._start(i) for i in range(self.n)]
            while not self.stopping:
                wait([p.sentinel for p, _ in self.slots], poll_s)
                for i, (p, ready) in enumerate(self.slots):
                    if self.stopping or p.exitcode is None:
                        continue
                    self.on_exit(p.pid or 0)
                    if not ready.is_set() and self._crash_looping():
                        log.error("workers keep dying before they serve: %d exits within %.0f s, the last "
                                  "(pid %s) %s; stopping (its log is above)", self.crash_loop.exits,
                                  self.crash_loop.window_s, p.pid, how(p.exitcode))  # fmt: skip
                        return 1
                    log.warning("worker %s %s: starting another", p.pid, how(p.exitcode))
                    self.slots[i] = self._start(i)
                    self.restarts += 1
                self._show()
            return 0
        finally:
            self._drain()

    def _start(self, slot: int) -> tuple[BaseProcess, Any]:
        process, ready = self.make(slot)
        process.start()
        return process, ready

    def _crash_looping(self) -> bool:
        now, window = time.monotonic(), self.crash_loop.window_s
        self._failed_starts.append(now)
        while self._failed_starts and self._failed_starts[0] < now - window:
            self._failed_starts.popleft()
        return len(self._failed_starts) >= self.crash_loop.exits

    def _show(self) -> None:
        shown = (sum(p.exitcode is None and ready.is_set() for p, ready in self.slots), self.restarts)
        if shown != self._shown:
            self._shown = shown
            self.on_change(*shown)

    def _drain(self) -> None:
        """SIGTERM to every worker, then wait for each; one still running at the deadline is killed."""
        for p, _ in self.slots:
            if p.exitcode is None and p.pid is not None:
                os.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.drain_s + STOP_GRACE_S
        for p, _ in self.slots:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode is None:
                log.error("worker %s did not drain in time: killed", p.pid)
                p.kill()
                p.join()
            self.on_exit(p.pid or 0)


def bind(config: ServeConfig, n: int) -> list[socket.socket]:
    """The frontend's ``n`` sockets, one a worker, bound to one port with ``SO_REUSEPORT`` (each
    worker listens on its own as it becomes ready; the kernel spreads connections over those that
    listen). A port another process holds is refused (``OSError``, address in use) as it was with
    one socket: a plain bind is tried first, which any socket on the port refuses, ``SO_REUSEPORT``
    or not (else a second frontend of the same user would join the first one's port)."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((config.host, config.port))
        port = probe.getsockname()[1]  # --port 0: the one the system chose
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.socket(family)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((config.host, port))
            sock.set_inheritable(True)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def serve_workers(config: ServeConfig, n: int) -> int:
    """Run ``n`` workers on the port of ``config`` until SIGTERM or SIGINT (0) or a crash loop (1)."""
    from serving.scoring.lean import announce, inference_key

    announce(config, f"{n} worker processes")
    if not config.disable_token_auth:
        inference_key(config.key_path())  # the key file is made once, here, before the workers read it
    log.info("preloaded for the workers: %s", preload(config))
    try:
        socks = bind(config, n)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", config.host, config.port, e)
        return 1
    metrics_dir = tempfile.mkdtemp(prefix="recserve-serve-metrics-")
    os.environ[multiproc.ENV] = metrics_dir  # the workers' metric objects write their files there
    members = roster.roster_dir(config.store, config.model)
    ctx = multiprocessing.get_context("fork")  # from this process as preloaded: no thread runs in it
    level = logging.getLogger().getEffectiveLevel()

    def make(slot: int) -> tuple[BaseProcess, Any]:
        ready = ctx.Event()
        args = (config, socks[slot], ready, metrics_dir, level, os.getpid())
        return ctx.Process(target=run_worker, args=args, name="recserve-serve-worker"), ready

    def exited(pid: int) -> None:
        multiproc.mark_dead(metrics_dir, pid)
        roster.remove(members, pid)

    def changed(serving: int, restarts: int) -> None:
        multiproc.write_collected(metrics_dir, multiproc.parent_families(serving, restarts))

    workers = Workers(n, make, drain_s=config.drain_s, on_exit=exited, on_change=changed)
    changed(0, 0)
    signal.signal(signal.SIGTERM, workers.stop)
    signal.signal(signal.SIGINT, workers.stop)
    try:
        code = workers.run()
    finally:
        for sock in socks:
            sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if code == 0:
        log.info("stopped: every worker drained")
    return code


def run_worker(config: ServeConfig, sock: socket.socket, ready: Any, metrics_dir: str, level: int,
               parent: int) -> None:  # fmt: skip
    """A worker process, forked from the parent: the one-process frontend on ``sock``, its metrics in
    ``metrics_dir``."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handlers, inherited by the fork
    signal.signal(signal.SIGINT, signal.default_int_handler)
    logging.basicConfig(level=level, format=LOG_FORMAT, force=True)  # its lines name its pid
    from serving.rpc.procs import term_with_parent

    term_with_parent()
    if os.getppid() != parent:  # the parent died before the line above
        sys.exit(1)
    multiproc.use_files()
    from serving.scoring.asgi import App, FrontendProcess
    from serving.scoring.lean import Frontend, run

    registry = multiproc.WorkerRegistry()
    frontend = Frontend(config, registry)
    process = FrontendProcess(multiproc.frontend_registry(metrics_dir, registry.collect_own), ready.set)
    snapshots = multiproc.Snapshots(metrics_dir, registry.collect_own)
    try:
        code = run(frontend, App(frontend, process), sock, parent)
    finally:
        snapshots.close()
    sys.exit(code)
