"""``<run_dir>/stack.json``: the running stack's state, a typed and versioned record
(``StackState``) that several processes share. This module is its one reader and one writer.

``up`` writes it whole when the stack has started; afterwards the controller (``dense_version``,
``refused``) and the supervisor (``pids``, ``started_at``, ``restarts``, ``deaths``,
``last_death``) each change their own fields while the other may be writing too. So every change
is a read-modify-write under an exclusive ``flock`` on ``stack.json.lock`` (``update_state``), and
the file is replaced atomically (readers without the lock see the old state or the new one, never
a half-written file). A file of another ``format`` (a stack started by another recserve) is
refused with what to do, never half-read.

What other tools do with it lives beside: ``serving.stack.down`` (stop what it lists),
``serving.stack.view`` (ask each process listed what it serves) and ``serving.stack.metrics``
(the stack's /metrics endpoints: Prometheus' targets and what a scoring process reports).
"""

from __future__ import annotations

import fcntl
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from serving.stack.config import StackConfig

STATE = "stack.json"
FORMAT = 1
"""The version of stack.json's layout; bumped when a field changes meaning or goes away."""


@dataclass
class Command:
    """How a process of the stack was started (the supervisor starts it again the same way)."""

    args: list[str]
    """``recserve`` arguments."""
    log: str
    """Log file (appended to by a replacement)."""


@dataclass
class Death:
    """How a process last ended, as the supervisor found it."""

    at: float
    """When (time.time())."""
    how: str
    """Exit status or signal ("exit status unknown" for a process ``up`` started)."""


@dataclass
class ServedShard:
    """What a PS process served when ``up`` finished starting."""

    address: str
    shard: int
    version: str
    delta_seq: int
    rows: int


@dataclass
class StackState:
    """Everything a running stack's processes and tools need to know about it."""

    model: str
    version: str
    """The version ``up`` served (the controller follows CURRENT from there)."""
    run_dir: str
    config: StackConfig
    """What ``up`` was asked for (``LocalStack.attach`` rebuilds the stack from it)."""
    format: int = FORMAT
    pin: str = ""
    """The version every part serves for good ('' follows CURRENT): ``up --version`` naming a
    version that is not CURRENT."""
    started: float = 0.0
    """When ``up`` finished (time.time())."""
    pids: dict[str, int] = field(default_factory=dict)
    """Process name (ps0, ps0.1, worker, torchserve, controller, supervisor) -> pid."""
    started_at: dict[str, int | None] = field(default_factory=dict)
    """Process name -> kernel start time: with the pid, an identity a recycled pid cannot match."""
    commands: dict[str, Command] = field(default_factory=dict)
    tls: dict[str, dict[str, str]] | None = None
    """``serving.stack.tls``: the server and client certificates (None: plaintext)."""
    ps: list[str] = field(default_factory=list)
    """Every PS process's address, shard by shard."""
    ps_shards: list[list[str]] = field(default_factory=list)
    """Per shard, its replicas' addresses."""
    shards: list[ServedShard] = field(default_factory=list)
    worker: str = ""
    """The embedding worker's address."""
    torchserve_ports: list[int] = field(default_factory=list)
    """inference, management, metrics, gRPC inference, gRPC management (a restart reuses them)."""
    endpoint: str = ""
    """POST scoring requests here."""
    inference: str = ""
    management: str = ""
    metrics: str = ""
    metrics_endpoints: dict[str, str] = field(default_factory=dict)
    """Process name -> host:port of its /metrics."""
    token_auth: bool = True
    key_file: str | None = None
    """TorchServe's key file (None: token auth off)."""
    dense_version: str = ""
    """The dense version TorchServe serves by default (the controller moves it)."""
    refused: dict[str, str] = field(default_factory=dict)
    """Versions the controller refused -> why."""
    restarts: dict[str, int] = field(default_factory=dict)
    deaths: dict[str, int] = field(default_factory=dict)
    last_death: dict[str, Death] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str, where: str = STATE) -> StackState:
        raw = json.loads(text)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
            raise ValueError(
                f"{where}: stack state format {found!r}, this recserve reads format {FORMAT}; stop that "
                "stack with the recserve that started it (recserve down)"
            )
        unknown = set(raw) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"{where}: unknown fields {sorted(unknown)} in a format {FORMAT} stack state")
        typed: dict[str, Any] = {
            "config": StackConfig(**raw["config"]),
            "commands": {k: Command(**v) for k, v in raw.get("commands", {}).items()},
            "shards": [ServedShard(**v) for v in raw.get("shards", [])],
            "last_death": {k: Death(**v) for k, v in raw.get("last_death", {}).items()},
        }
        return cls(**{**raw, **typed})


@contextmanager
def _locked(run_dir: Path) -> Iterator[None]:
    with open(run_dir / f"{STATE}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def state_exists(run_dir: str | Path) -> bool:
    return (Path(run_dir) / STATE).exists()


def read_state(run_dir: str | Path) -> StackState:
    """The state as it is now (FileNotFoundError when no stack runs from ``run_dir``)."""
    path = Path(run_dir) / STATE
    return StackState.from_json(path.read_text(), str(path))


def _write(run_dir: Path, state: StackState) -> None:
    tmp = run_dir / f"{STATE}.tmp"
    tmp.write_text(state.to_json())
    tmp.replace(run_dir / STATE)


def write_state(run_dir: str | Path, state: StackState) -> None:
    """Replace the whole state (``up``, before anything else writes it)."""
    with _locked(Path(run_dir)):
        _write(Path(run_dir), state)


def update_state(run_dir: str | Path, change: Callable[[StackState], None]) -> StackState:
    """Apply ``change`` to the state as it is now, under the lock; returns the new state."""
    run_dir = Path(run_dir)
    with _locked(run_dir):
        state = read_state(run_dir)
        change(state)
        _write(run_dir, state)
    return state


def remove_state(run_dir: str | Path) -> None:
    """The stack is stopped: its state goes (the supervisor stops when it finds none)."""
    (Path(run_dir) / STATE).unlink(missing_ok=True)
