"""The stack's supervisor (``recserve supervisor``, started last by ``recserve up``): every process
of the stack that dies is started again.

``up`` starts the processes and exits; the supervisor stays. It reads ``<run_dir>/stack.json``:
for each process, its pid, its kernel start time (an identity a recycled pid cannot match) and,
under ``commands``, the command line and log file it was started with. Every ``poll_s`` it checks
each one. A process that is gone (or a zombie) is logged with how it ended (its exit status or
signal when the supervisor started it; "status unknown" when ``up`` did) and started again with
the same command -- the same ports, the same store, the same log file (appended) -- after a
backoff: at once the first time, then ``backoff_s``, doubling up to ``max_backoff_s`` while it
keeps dying within ``stable_s`` of its start. The replacement's pid and start time, and the
restart count per process (``restarts``; ``deaths`` counts how often each was found dead, and
``last_death`` says when and how it last ended) go into stack.json (``serving.stack.state``), so
``recserve down`` stops the replacement.

What a restart means:
- a PS replica loads CURRENT and its deltas before it listens (``serving/ps/server.py``), so it
  reports SERVING with the version and delta seq the others serve; the worker's health checks put
  it back into the rotation (``serving.worker.replicas``) once it does;
- the worker connects to the PS shards again on its old port; the scoring handler's channel
  reconnects to it;
- the controller attaches to stack.json again and goes on following CURRENT.

- TorchServe is started again on its old ports (``LocalStack.restart_torchserve``) and the dense
  version the stack served is registered and made the default before it counts as restarted; with
  token auth on it writes new keys into the same key file.

The supervisor is not supervised itself; ``recserve down`` stops it first, so nothing is
restarted while the stack stops.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from serving.rpc.procs import running, spawn, start_time
from serving.stack.state import Command, Death, StackState, read_state, update_state

log = logging.getLogger("recserve.supervisor")


@dataclass
class SupervisorConfig:
    """The supervisor beside a running stack."""

    run_dir: str = field(default="", metadata={"help": "the stack's run dir (reads stack.json)"})
    """The stack's run dir (reads and updates stack.json)."""
    poll_s: float = 0.25
    """How often every process is checked."""
    backoff_s: float = 0.5
    """Delay before the second restart of a process that keeps dying (the first is at once)."""
    max_backoff_s: float = 30.0
    """The backoff doubles up to this."""
    stable_s: float = 60.0
    """A process that ran this long counts as healthy again: its next restart is at once."""

    def __post_init__(self) -> None:
        if not self.run_dir:
            raise ValueError("--run-dir is required")
        if self.poll_s <= 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError("need poll_s > 0 and 0 <= backoff_s <= max_backoff_s")


class Supervisor:
    def __init__(self, config: SupervisorConfig):
        self.config = config
        self.run_dir = Path(config.run_dir).resolve()
        self.children: dict[str, subprocess.Popen] = {}  # the replacements this process started
        self.down_since: dict[str, float] = {}  # name -> when it was found dead (monotonic)
        self.quick_failures: dict[str, int] = {}  # deaths within stable_s of a start, in a row
        self.started: dict[str, float] = {}  # name -> when this supervisor last started it

    def step(self) -> list[str]:
        """One pass: restart what is dead and due; returns the names restarted."""
        state = read_state(self.run_dir)
        now = time.monotonic()
        restarted = []
        for name, pid in state.pids.items():
            if name == "supervisor":
                continue
            if self._running(name, pid, state.started_at.get(name)):
                if now - self.started.get(name, -1e9) > self.config.stable_s:
                    self.quick_failures.pop(name, None)
                continue
            command: Command | str | None = state.commands.get(name)
            if name == "torchserve":
                command = "torchserve"  # not a command line: LocalStack.restart_torchserve
            if name not in self.down_since:
                self.down_since[name] = now
                ended = self._how_it_ended(name, pid)
                self._record(name, ended)
                if command is None:
                    log.error(
                        "%s (pid %d) %s; not restarted (restart the stack: recserve down, up)",
                        name,
                        pid,
                        ended,
                    )
                else:
                    log.error("%s (pid %d) %s; restarting in %.1fs", name, pid, ended, self._backoff(name))
            if command is None or now - self.down_since[name] < self._backoff(name):
                continue
            self._restart(name, command, now)
            restarted.append(name)
        return restarted

    def _running(self, name: str, pid: int, started: int | None) -> bool:
        child = self.children.get(name)
        if child is not None and child.pid == pid:
            return child.poll() is None  # reaps it when it ended
        return running(pid, started)

    def _how_it_ended(self, name: str, pid: int) -> str:
        child = self.children.get(name)
        if child is None or child.pid != pid or child.returncode is None:
            return "ended (exit status unknown: started by `up`, not by this supervisor)"
        code = child.returncode
        return f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"

    def _backoff(self, name: str) -> float:
        k = self.quick_failures.get(name, 0)
        if k == 0:
            return 0.0
        return min(self.config.backoff_s * 2 ** (k - 1), self.config.max_backoff_s)

    def _record(self, name: str, ended: str) -> None:
        def change(state: StackState) -> None:
            state.deaths[name] = state.deaths.get(name, 0) + 1
            state.last_death[name] = Death(at=time.time(), how=ended)

        update_state(self.run_dir, change)

    def _restart(self, name: str, command: Command | str, now: float) -> None:
        if isinstance(command, Command):
            proc = spawn(command.args, Path(command.log))
        else:  # "torchserve"
            from serving.stack.local import LocalStack

            proc = LocalStack.attach(self.run_dir).restart_torchserve()._proc  # started and serving
        self.children[name] = proc
        self.started[name] = now
        self.quick_failures[name] = self.quick_failures.get(name, 0) + 1
        down_s = now - self.down_since.pop(name)
        began = start_time(proc.pid)

        def change(state: StackState) -> None:
            state.pids[name] = proc.pid
            state.started_at[name] = began
            state.restarts[name] = state.restarts.get(name, 0) + 1

        state = update_state(self.run_dir, change)
        log.warning("restarted %s as pid %d (restart %d; found dead %.2fs earlier)",
                    name, proc.pid, state.restarts[name], down_s)  # fmt: skip


def run_supervisor(config: SupervisorConfig) -> int:
    sup = Supervisor(config)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    names = sorted(read_state(sup.run_dir).commands)
    log.info("supervising %s from %s", ", ".join(names), sup.run_dir)
    while not stopping:
        try:
            sup.step()
        except FileNotFoundError:  # stack.json is gone: the stack was stopped
            log.info("%s/stack.json is gone: stopping", sup.run_dir)
            return 0
        except Exception:  # keep supervising: the next pass may succeed
            log.exception("supervision pass failed")
        time.sleep(config.poll_s)
    log.info("stopped (SIGTERM); the stack's processes are left to `recserve down`")
    return 0
