"""The processes that serve a model's endpoint, for ``recserve versions``: every ``recserve serve``
process (each worker of a frontend of several, ``--workers``) keeps a ``FrontendRecord`` in
``<store>/.run/<model>/frontends/<host>-<pid>.json``, rewritten every ``HEARTBEAT_S`` and at exit
removed (the parent removes a dead worker's). A record not rewritten for ``STALE_S`` (its process
gone without a word, its host down) is not listed. A store mounted read-only (a Kubernetes pod)
takes no records: the process says so once and serves on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger("recserve.serve")

FORMAT = "recserve.frontend/1"
HEARTBEAT_S = 2.0
STALE_S = 10.0


@dataclass
class FrontendRecord:
    """One scoring process as it last described itself."""

    pid: int
    parent: int
    """The pid of the parent that keeps it (``--workers N``); 0 for a frontend of one process."""
    address: str
    """The HOST:PORT it serves."""
    host: str = field(default_factory=socket.gethostname)
    version: str = ""
    """The dense version it serves ('' while none)."""
    deltas: list[int] = field(default_factory=list)
    """Per co-located shard, the last delta applied (-1: none yet)."""
    lookups: list[str] = field(default_factory=list)
    updated: float = field(default_factory=time.time)

    def line(self) -> str:
        """How ``recserve versions`` shows it."""
        keeper = f"worker of {self.parent}" if self.parent else "one process"
        served = f"version {self.version}" if self.version else "no version yet"
        if self.deltas:
            served += " delta " + ",".join(map(str, sorted(set(self.deltas))))
        lookups = f"  lookups {','.join(self.lookups)}" if self.lookups else ""
        return f"  {self.address}  pid {self.pid} ({keeper})  {served}{lookups}"


def roster_dir(store: str | Path, model: str) -> Path:
    return Path(store) / ".run" / model / "frontends"


def _path(directory: Path, pid: int, host: str = "") -> Path:
    return directory / f"{host or socket.gethostname()}-{pid}.json"


def write(directory: Path, record: FrontendRecord) -> None:
    """``record`` as its process's file, replaced whole."""
    directory.mkdir(parents=True, exist_ok=True)
    path = _path(directory, record.pid, record.host)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"format": FORMAT, **asdict(record)}))
    os.replace(tmp, path)


def read(directory: Path, now: float | None = None) -> list[FrontendRecord]:
    """The records rewritten within ``STALE_S``, by address and pid (unreadable ones skipped)."""
    now = time.time() if now is None else now
    out = []
    for path in directory.glob("*.json") if directory.is_dir() else []:
        try:
            raw = json.loads(path.read_text())
            if raw.pop("format", None) != FORMAT:
                continue
            record = FrontendRecord(**raw)
        except (OSError, ValueError, TypeError):  # replaced or removed under us, or another format
            continue
        if now - record.updated <= STALE_S:
            out.append(record)
    return sorted(out, key=lambda r: (r.address, r.parent, r.pid))


def remove(directory: Path, pid: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        _path(directory, pid).unlink()


@contextlib.contextmanager
def listed(directory: Path, describe: Callable[[], FrontendRecord]) -> Iterator[None]:
    """This process in the roster while the block runs: ``describe()`` written every
    ``HEARTBEAT_S`` on a daemon thread, removed at the end."""
    stop = threading.Event()

    def run() -> None:
        while True:
            try:
                write(directory, describe())
            except OSError as e:
                log.warning("not listed for `recserve versions` (%s): serving on", e)
                return
            if stop.wait(HEARTBEAT_S):
                return

    thread = threading.Thread(target=run, name="recserve-roster", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5.0)
        remove(directory, os.getpid())
