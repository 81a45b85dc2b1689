"""What a long bench samples over time (``Series``): each process's RSS and CPU time by name,
the model store's bytes on disk and the version CURRENT names."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import model_store as ms
from serving.rpc.procs import proc_stat


@dataclass(frozen=True)
class Sample:
    t: float
    rss: dict[str, int]
    """Process name -> RSS bytes."""
    cpu: dict[str, float]
    """Process name -> CPU seconds its processes have used (a restarted one counts from 0)."""
    disk: int
    """The store's bytes on disk."""
    current: str
    """The version CURRENT names."""
    retained: bool = True
    """Retention's work is done: the store holds no version it would delete (``ms.doomed``)."""
    pids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Process name -> the pids sampled under it."""
    pid_cpu: dict[int, float] = field(default_factory=dict)
    """Pid -> CPU seconds it has used: a name whose pids changed (a standby that took over, a
    restart) is counted from what its new pids had used at the sample before."""


class Series(threading.Thread):
    """A ``Sample`` every ``every_s`` into ``samples`` until ``halt``: ``pids()`` names the
    processes (name -> pids, asked at each sample: a restarted process has a new pid); ``keep``:
    retention's ``--keep-versions`` (None: no retention runs)."""

    def __init__(
        self,
        pids: Callable[[], dict[str, list[int]]],
        model_dir: Path,
        every_s: float,
        keep: int | None = None,
    ) -> None:
        super().__init__(name="series", daemon=True)
        self.pids, self.model_dir, self.every_s, self.keep = pids, model_dir, every_s, keep
        self.samples: list[Sample] = []
        self._halt = threading.Event()
        self._sealed: dict[tuple[str, int], int] = {}  # disk_bytes' complete deltas

    def run(self) -> None:
        while not self._halt.is_set():
            named = {name: tuple(pids) for name, pids in self.pids().items()}
            stats = {pid: proc_stat(pid) for pids in named.values() for pid in pids}
            pid_cpu = {pid: st.cpu_s for pid, st in stats.items() if st is not None}
            rss = {
                n: sum(st.rss_bytes for p in pids if (st := stats[p]) is not None)
                for n, pids in named.items()
            }
            cpu = {n: sum(pid_cpu.get(p, 0.0) for p in pids) for n, pids in named.items()}
            current = ms.current(self.model_dir.parent, self.model_dir.name) or ""
            retained = self.keep is None or not (
                self.model_dir.is_dir() and ms.doomed(self.model_dir.parent, self.model_dir.name, self.keep)
            )
            disk = disk_bytes(self.model_dir, self._sealed)
            self.samples.append(Sample(time.time(), rss, cpu, disk, current, retained, named, pid_cpu))
            self._halt.wait(self.every_s)

    def floors(self) -> list[tuple[str, int | None]]:
        """(version, the store's fewest bytes while CURRENT named it) of each version CURRENT named,
        in order: after the retention its publish ran, before its deltas pile up. With ``keep``,
        only samples where retention's work was done count (deleting a version's thousand deltas
        takes seconds), None for a version with none (its retention still running when the
        samples ended)."""
        out: list[tuple[str, int | None]] = []
        for s in self.samples:
            disk = s.disk if s.retained else None
            if out and out[-1][0] == s.current:
                was = out[-1][1]
                out[-1] = (s.current, disk if was is None else was if disk is None else min(was, disk))
            else:
                out.append((s.current, disk))
        return out

    def cpu_pct(self, a: float, b: float) -> dict[str, float]:
        """Each name's CPU use from ``a`` to ``b``, in % of one CPU (from the samples between; a
        process new since the sample before counts from 0, one that was there under another name
        from what it had used then)."""
        got = [x for x in self.samples if a <= x.t < b]
        if len(got) < 2:
            return {}
        out: dict[str, float] = {}
        for before, after in zip(got[:-1], got[1:], strict=True):
            for name, now in after.cpu.items():
                if name in after.pids:
                    used = sum(
                        after.pid_cpu.get(p, 0.0) - before.pid_cpu.get(p, 0.0) for p in after.pids[name]
                    )
                else:  # samples without their pids: a name whose CPU fell was restarted
                    was = before.cpu.get(name, 0.0)
                    used = now - was if now >= was else now
                out[name] = out.get(name, 0.0) + used
        span = got[-1].t - got[0].t
        return {name: round(100 * used / span, 1) for name, used in out.items()}

    def halt(self) -> None:
        self._halt.set()
        self.join()


def disk_bytes(path: Path, sealed: dict[tuple[str, int], int] | None = None) -> int:
    """Bytes allocated on disk under ``path`` (files that vanish meanwhile: not counted).
    ``sealed``: the bytes of each complete delta directory counted before, by (path, inode), kept
    across calls: a delta is written whole before its ``_SUCCESS``, then never changed, and a
    half-hour soak's store holds thousands of them (tens of thousands of files to look at every
    sample otherwise)."""
    total = 0
    for d, dirs, files in os.walk(path):
        if sealed is not None and ms.SUCCESS in files and Path(d).parent.name == ms.DELTAS:
            with contextlib.suppress(FileNotFoundError):
                key = (d, os.lstat(d).st_ino)
                if key not in sealed:
                    sealed[key] = disk_bytes(Path(d))
                total += sealed[key]
            dirs[:] = []  # counted whole
            continue
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.lstat(os.path.join(d, f)).st_blocks * 512
    return total
