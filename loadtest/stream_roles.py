"""The stream's roles in a bench (``recserve join``, ``recserve train --follow`` and its warm
standby, spawned by the bench as processes of their own, each logging to ``<work>/<role>.log``):
ready, alive, killed and replaced, and what their /metrics say. Shared by bench-stream and
bench-soak."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

from loadtest.processes import log_excerpt, wait_for
from serving.rpc.procs import spawn

LAG_GAUGE = "recserve_follow_lag_samples"
"""The trainer's consumer lag on its /metrics (samples after those it trained, at its last look)."""
STANDBY = "trainer-standby"
"""A second trainer of the model (training/follow/standby.py): it takes over when the trainer dies."""
STANDBY_GAUGE = "recserve_follow_standby"


def standby_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--standby", action=argparse.BooleanOptionalAction, default=True,
                   help="run the trainer with a warm standby, which takes over when it is killed (default: on)")  # fmt: skip


def log_of(work: Path, name: str) -> Path:
    """A role's log; the trainer and its standby share ``trainer.log`` (either may be the trainer)."""
    return work / f"{name.partition('-')[0]}.log"


def trainer_roles(argv: list[str], ports: list[int], standby: bool) -> dict[str, list[str]]:
    """The trainer's command with its own /metrics port, and its standby's with another."""
    roles = {"trainer": [*argv, "--metrics-port", str(ports[0])]}
    return roles | ({STANDBY: [*argv, "--metrics-port", str(ports[1])]} if standby else {})


def port_of(argv: list[str]) -> int:
    return int(argv[argv.index("--metrics-port") + 1])


def start(roles: dict[str, list[str]], procs: dict, work: Path, name: str) -> None:
    procs[name] = spawn(roles[name], log_of(work, name))


def standing_by(roles: dict[str, list[str]], procs: dict, work: Path, timeout_s: float = 120.0) -> None:
    """Start the trainer's standby (if the bench runs one) and return once it stands by."""
    if STANDBY not in roles:
        return
    start(roles, procs, work, STANDBY)
    port = port_of(roles[STANDBY])
    wait_for(lambda: scrape(port, STANDBY_GAUGE) == 1.0, timeout_s, "the trainer's standby standing by",
             [(n, p, log_of(work, n)) for n, p in procs.items()])  # fmt: skip


def kill(roles: dict[str, list[str]], procs: dict, work: Path, name: str) -> None:
    """SIGKILL role ``name`` and start it again at once. The trainer's standby, if it runs, takes
    over instead, and a new standby starts (on the killed trainer's port)."""
    os.killpg(procs[name].pid, signal.SIGKILL)
    procs[name].wait()
    if name == "trainer" and STANDBY in procs:
        procs["trainer"] = procs.pop(STANDBY)
        roles["trainer"], roles[STANDBY] = roles[STANDBY], roles["trainer"]
        name = STANDBY
    start(roles, procs, work, name)


def until_ready(roles: dict[str, list[str]], procs: dict, work: Path, timeout_s: float = 120.0) -> None:
    """Return once the joiner holds its partitions (its log says so), the trainer has read (its
    lag gauge is up) and its standby, if any, stands by: the load starts then, as a deployment
    starts them before its traffic. Their restarts are what the kills measure."""
    joined, port = log_of(work, "joiner"), port_of(roles["trainer"])
    wait_for(lambda: "join: assigned partitions" in joined.read_text(errors="replace")
             and scrape(port, LAG_GAUGE) is not None, timeout_s, "joiner assigned and trainer reading",
             [(n, p, log_of(work, n)) for n, p in procs.items()])  # fmt: skip
    standing_by(roles, procs, work, timeout_s)


def alive(procs: dict, work: Path) -> None:
    """A RuntimeError with the end of its log if a role exited by itself."""
    for name, proc in procs.items():
        if proc.poll() is not None:
            raise RuntimeError(
                f"the {name} exited ({proc.returncode}) by itself:\n{log_excerpt(log_of(work, name))}"
            )


def scrape(port: int, name: str) -> float | None:
    """The value of the metric ``name`` (no labels) on 127.0.0.1:``port``/metrics; None when the
    process does not answer (not up yet, killed) or has no such metric."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=0.5) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None
