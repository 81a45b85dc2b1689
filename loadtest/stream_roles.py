"""The stream's roles in a bench (``recserve join``, ``recserve train --follow``, spawned by the
bench as processes of their own, each logging to ``<work>/<name>.log``): ready, alive, and what
their /metrics say. Shared by bench-stream and bench-soak."""

from __future__ import annotations

from pathlib import Path

from loadtest.processes import log_excerpt, wait_for

LAG_GAUGE = "recserve_follow_lag_samples"
"""The trainer's consumer lag on its /metrics (samples after those it trained, at its last look)."""


def until_ready(procs: dict, work: Path, metrics_port: int, timeout_s: float = 120.0) -> None:
    """Return once the joiner holds its partitions (its log says so) and the trainer has read (its
    lag gauge is up): the load starts then, as a deployment starts them before its traffic. Their
    restarts are what the kills measure."""
    joined = work / "joiner.log"
    wait_for(lambda: "join: assigned partitions" in joined.read_text(errors="replace")
             and scrape(metrics_port, LAG_GAUGE) is not None, timeout_s, "joiner assigned and trainer reading",
             [(n, p, work / f"{n}.log") for n, p in procs.items()])  # fmt: skip


def alive(procs: dict, work: Path) -> None:
    """A RuntimeError with the end of its log if a role exited by itself."""
    for name, proc in procs.items():
        if proc.poll() is not None:
            raise RuntimeError(
                f"the {name} exited ({proc.returncode}) by itself:\n{log_excerpt(work / f'{name}.log')}"
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
