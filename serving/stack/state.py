"""``<run_dir>/stack.json``: the running stack's state, a typed and versioned record
(``StackState``) that several processes share. This module is its one reader and one writer.

``up`` writes it whole when the stack has started; afterwards the controller (``dense_version``,
``refused``) and the supervisor (``pids``, ``started_at``, ``restarts``, ``deaths``,
``last_death``) each change their own fields while the other may be writing too. So every change
is a read-modify-write under an exclusive ``flock`` on ``stack.json.lock`` (``update_state``), and
the file is replaced atomically (readers without the lock see the old state or the new one, never
a half-written file). A file of another ``format`` (a stack started by another recserve) is
refused with what to do, never half-read.

What is read from it by other processes lives here too: ``down`` (stop what it lists) and
``serving_view`` (ask each process listed what it serves).
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


def serving_view(run_dir: str | Path, timeout_s: float = 2.0) -> dict | None:
    """What the stack running from ``run_dir`` actually serves, asked of its processes: each PS
    shard's ``version``, ``delta_seq`` and ``refusal`` (why it does not serve CURRENT's version;
    Stats), the worker's version (Stats), the dense version TorchServe serves by default and the
    versions the controller refused with why (stack.json), and where TorchServe's handler reads each
    shard's rows (``lookups``, from its /metrics). A process that does not answer has ``error``
    instead. None when no stack runs from ``run_dir``."""
    try:
        state = read_state(run_dir)
    except FileNotFoundError:
        return None
    from serving.ps.client import PSClient, ShardError
    from serving.stack import tls as stack_tls
    from serving.worker.client import WorkerClient

    shards = []
    for address in state.ps:
        try:
            with PSClient(address, timeout_s=timeout_s, tls=stack_tls.client(state)) as client:
                st = client.stats()
            shards.append({"address": address, "shard": st["shard"], "version": st["version"],
                           "delta_seq": st["delta_seq"], "refusal": st["refusal"]})  # fmt: skip
        except ShardError as e:
            shards.append({"address": address, "error": str(e)})
    worker = None
    if state.worker:
        worker = {"address": state.worker}
        try:
            with WorkerClient(state.worker, timeout_s=timeout_s, tls=stack_tls.client(state)) as client:
                worker["version"], worker["delta_seq"] = client.stats()["version"]
        except (ConnectionError, RuntimeError) as e:
            worker["error"] = str(e)
    scoring = state.metrics_endpoints.get("torchserve")
    return {"run_dir": str(run_dir), "ps": shards, "worker": worker, "dense_version": state.dense_version or None,
            "refused": state.refused, "restarts": state.restarts,
            "lookups": lookup_modes(scoring, timeout_s) if scoring else None}  # fmt: skip


def lookup_modes(metrics_address: str, timeout_s: float = 2.0) -> dict:
    """What the scoring processes behind ``metrics_address`` (HOST:PORT of a /metrics) report of
    how they score: where they read each shard's rows (``recserve_scoring_lookup_mode == 1``) and
    their dense runtime and device (``recserve_scoring_dense_runtime == 1``,
    ``recserve_scoring_dense_device == 1``), and what their impression log
    delivered and dropped: ``{"shards": {shard: [modes]}, "runtimes": [runtimes], "devices": [devices], "impressions":
    {"logged": n, "dropped": n} or None}`` (several while versions that chose differently are loaded side by
    side), or ``{"error": why}`` when the endpoint does not answer."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    from serving.scoring.impressions import DROPPED, LOGGED
    from serving.scoring.names import DENSE_DEVICE, DENSE_RUNTIME, LOOKUP_MODE

    try:
        with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=timeout_s) as r:
            text = r.read().decode()
    except OSError as e:
        return {"error": str(e)}
    modes: dict[int, set[str]] = {}
    runtimes: set[str] = set()
    devices: set[str] = set()
    impressions: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for counter, key in ((DROPPED, "dropped"), (LOGGED, "logged")):
            if family.name in (counter, counter.removesuffix("_total")):
                total = sum(s.value for s in family.samples if s.name == counter)
                impressions[key] = impressions.get(key, 0) + total
        if family.name == LOOKUP_MODE:
            for sample in family.samples:
                if sample.value == 1:
                    modes.setdefault(int(sample.labels["shard"]), set()).add(sample.labels["mode"])
        elif family.name == DENSE_RUNTIME:
            runtimes |= {sample.labels["runtime"] for sample in family.samples if sample.value == 1}
        elif family.name == DENSE_DEVICE:
            devices |= {sample.labels["device"] for sample in family.samples if sample.value == 1}
    return {"shards": {shard: sorted(m) for shard, m in sorted(modes.items())}, "runtimes": sorted(runtimes),
            "devices": sorted(devices),
            "impressions": {k: int(v) for k, v in impressions.items()} or None}  # fmt: skip


def any_alive(state: StackState) -> bool:
    """Whether a process recorded in ``state`` still runs."""
    from serving.rpc.procs import alive

    return any(alive(pid) for pid in state.pids.values())


def down(run_dir: Path) -> list[str]:
    """Stop the processes a previous ``up`` recorded in ``run_dir/stack.json``; returns their names.
    The supervisor first (it would restart what is stopped), then the controller, then the rest as
    stack.json names them once the supervisor is gone (its last replacements included)."""
    from serving.rpc.procs import stop_pids

    if not state_exists(run_dir):
        return []
    stopped: list[str] = []
    for group in (("supervisor",), ("controller",), None):  # None: the rest, all at once
        state = read_state(run_dir)
        names = {
            int(pid): name
            for name, pid in state.pids.items()
            if name not in stopped and (name in group if group else name not in ("supervisor", "controller"))
        }
        marker = lambda name: "org.pytorch.serve.ModelServer" if name == "torchserve" else "recserve"  # noqa: E731
        targets = [(pid, marker(name), state.started_at.get(name)) for pid, name in names.items()]
        stopped += [names[pid] for pid in stop_pids(targets)]
    remove_state(run_dir)
    return stopped


def write_prometheus_targets(run_dir: str | Path, state: StackState) -> Path:
    """``<run_dir>/prometheus-targets.json``: every /metrics endpoint of the stack in Prometheus'
    file service discovery format (deploy/prometheus/prometheus.yml reads it), labelled by component
    (``ps0.1`` -> ``ps``)."""
    from model_store import write_atomic

    groups = [
        {"targets": [address], "labels": {"component": name.rstrip("0123456789."), "instance_name": name}}
        for name, address in sorted(state.metrics_endpoints.items())
    ]
    path = Path(run_dir) / "prometheus-targets.json"
    write_atomic(path, json.dumps(groups, indent=2).encode())
    return path
