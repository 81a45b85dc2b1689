"""``<run_dir>/stack.json``: the running stack's state, written by several processes.

``up`` writes it whole when the stack has started; afterwards the controller (``dense_version``,
``refused``) and the supervisor (``pids``, ``started_at``, ``restarts``) each change their own
entries of it while the other may be writing too. So every change is a read-modify-write under an
exclusive ``flock`` on ``stack.json.lock``, and the file is replaced atomically (readers without
the lock see the old state or the new one, never a half-written file).
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

STATE = "stack.json"


@contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    with open(run_dir / f"{STATE}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_state(run_dir: str | Path) -> dict:
    """The state as it is now (FileNotFoundError when no stack runs from ``run_dir``)."""
    return json.loads((Path(run_dir) / STATE).read_text())


def _write(run_dir: Path, state: dict) -> None:
    tmp = run_dir / f"{STATE}.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    tmp.replace(run_dir / STATE)


def write_state(run_dir: str | Path, state: dict) -> None:
    """Replace the whole state (``up``, before anything else writes it)."""
    with _locked(Path(run_dir)):
        _write(Path(run_dir), state)


def update_state(run_dir: str | Path, change: Callable[[dict], None]) -> dict:
    """Apply ``change`` to the state as it is now, under the lock; returns the new state."""
    run_dir = Path(run_dir)
    with _locked(run_dir):
        state = read_state(run_dir)
        change(state)
        _write(run_dir, state)
    return state
