"""The stream's roles in a bench (``recserve join``, ``recserve train --follow`` and its warm
standby, spawned by the bench as processes of their own, each logging to ``<work>/<role>.log``):
ready, alive, killed and replaced, and what their /metrics say. Shared by bench-stream and
bench-soak."""

from __future__ import annotations

import argparse
import math
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from loadtest.processes import log_excerpt, machine_busy_s, wait_for
from loadtest.stream_topics import TOPICS, watermarks
from model_store.deltas import last_record
from serving.rpc.procs import spawn

LAG_GAUGE = "recserve_follow_lag_samples"
"""The trainer's consumer lag on its /metrics (samples after those it trained, at its last look)."""
STANDBY = "trainer-standby"
"""A second trainer of the model (training/follow/standby.py): it takes over when the trainer dies."""
STANDBY_GAUGE = "recserve_follow_standby"


GUARD_WINDOW_SAMPLES = 2000
"""The output guard's window (``recserve train --guard-window-samples``, its default)."""


def guard_warmup(window_s: float, samples_per_s: float) -> list[str]:
    """The streaming trainer's ``--guard-warmup-windows`` for a bench's traffic: the output guard's
    windows in two join windows of samples, at least its default 5. A trainer that starts
    mid-stream (a standby taking over, a restart) reads, for a join window, the negatives of
    requests whose clicks its predecessor read: windows with too few clicks. The default 5 windows
    are 1 s of 10,000 samples/s, so such windows formed the band, the first steady window tripped
    it (calibration 0.31 x the band's) and none cleared it: the trainer held every sample after
    (2,059,140 lost at 50 requests/s x 200 items)."""
    return [
        "--guard-warmup-windows",
        str(max(5, math.ceil(2 * window_s * samples_per_s / GUARD_WINDOW_SAMPLES))),
    ]


def input_guard_warmup(window_s: float, items_per_s: float) -> list[str]:
    """The joiner's ``--guard-warmup-items`` for a bench's traffic: two join windows of impressed
    items, at least its default (``stream.guard.GuardConfig.warmup_items``). The input guard judges
    rates of arrival, and a restarted joiner's first seconds are its replay. At 12,000 items/s the
    default 5,000 items are 0.4 s: in the first bench-soak at 200 items the restarted joiner's band
    formed at a label rate of 0.288 (steady: about 0.1, 1,140 clicks/s over 11,700 items/s), its
    replay tripped the guard 7 s after the kill (0.064 over 231,600 items < 0.25 x the band), and
    clearing needs 0.5 x the band, above the steady rate: it never cleared, every window after was
    held 120 s and quarantined, and the trainer lost the last 15 minutes (10.7 million samples)."""
    from stream.guard import GuardConfig

    return ["--guard-warmup-items", str(max(GuardConfig.warmup_items, math.ceil(2 * window_s * items_per_s)))]


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


def trained_offsets(vdir: Path) -> list[int]:
    """Per partition of the samples topic, where the last published delta's trainer resumes."""
    last = last_record(vdir)
    at = last[0].positions if last is not None else {}
    return [at.get(f"samples/{p}", 0) for p in range(TOPICS["samples"])]


class Looks:
    """What bench-stream looks at once a second during the load (``look``): ``lags``, (time, the
    samples the trainer's published offsets, its last delta's, are behind the samples topic's
    end); ``gauge``, what the trainer's own lag gauge said; ``trimmed``, the most samples the
    broker's retention had dropped before the trainer's offsets reached them; ``busy``, (time, the
    machine's busy CPU seconds so far: ``loadtest.processes.machine_busy_s``)."""

    def __init__(self, watch, vdir: Path, port: Callable[[], int]) -> None:
        self.watch, self.vdir, self.port = watch, vdir, port
        self.lags: list[tuple[float, int]] = []
        self.gauge: list[float] = []
        self.trimmed = 0
        self.busy: list[tuple[float, float]] = []

    def look(self) -> None:
        low, high = watermarks(self.watch, "samples")
        pos = trained_offsets(self.vdir)
        self.lags.append((time.time(), sum(high) - sum(pos)))
        self.busy.append((time.time(), machine_busy_s()))
        if (g := scrape(self.port(), LAG_GAUGE)) is not None:
            self.gauge.append(g)
        self.trimmed = max(self.trimmed, sum(max(0, lo - a) for lo, a in zip(low, pos, strict=True)))
