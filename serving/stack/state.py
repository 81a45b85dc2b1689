"""``<run_dir>/stack.json``: the running stack's state, written by several processes.

``up`` writes it whole when the stack has started; afterwards the controller (``dense_version``,
``refused``) and the supervisor (``pids``, ``started_at``, ``restarts``) each change their own
entries of it while the other may be writing too. So every change is a read-modify-write under an
exclusive ``flock`` on ``stack.json.lock``, and the file is replaced atomically (readers without
the lock see the old state or the new one, never a half-written file).

What is read from it by other processes lives here too: ``down`` (stop what it lists) and
``serving_view`` (ask each process listed what it serves).
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


def serving_view(run_dir: str | Path, timeout_s: float = 2.0) -> dict | None:
    """What the stack running from ``run_dir`` actually serves, asked of its processes: each PS
    shard's ``version``, ``delta_seq`` and ``refusal`` (why it does not serve CURRENT's version;
    Stats), the worker's version (Stats), the dense version TorchServe serves by default and the
    versions the controller refused with why (stack.json). A process that does not answer has
    ``error`` instead. None when no stack runs from ``run_dir``."""
    try:
        state = read_state(run_dir)
    except FileNotFoundError:
        return None
    from serving.ps.client import PSClient, ShardError
    from serving.stack import tls as stack_tls
    from serving.worker.client import WorkerClient

    shards = []
    for address in state.get("ps", []):
        try:
            with PSClient(address, timeout_s=timeout_s, tls=stack_tls.client(state)) as client:
                st = client.stats()
            shards.append({"address": address, "shard": st["shard"], "version": st["version"],
                           "delta_seq": st["delta_seq"], "refusal": st["refusal"]})  # fmt: skip
        except ShardError as e:
            shards.append({"address": address, "error": str(e)})
    worker = None
    if state.get("worker"):
        worker = {"address": state["worker"]}
        try:
            with WorkerClient(state["worker"], timeout_s=timeout_s, tls=stack_tls.client(state)) as client:
                worker["version"], worker["delta_seq"] = client.stats()["version"]
        except (ConnectionError, RuntimeError) as e:
            worker["error"] = str(e)
    return {"run_dir": str(run_dir), "ps": shards, "worker": worker, "dense_version": state.get("dense_version"),
            "refused": state.get("refused", {}), "restarts": state.get("restarts", {})}  # fmt: skip


def any_alive(state: dict) -> bool:
    """Whether a process recorded in ``state`` still runs."""
    from serving.rpc.procs import alive

    return any(alive(pid) for pid in state.get("pids", {}).values())


def down(run_dir: Path) -> list[str]:
    """Stop the processes a previous ``up`` recorded in ``run_dir/stack.json``; returns their names.
    The supervisor first (it would restart what is stopped), then the controller, then the rest as
    stack.json names them once the supervisor is gone (its last replacements included)."""
    from serving.rpc.procs import stop_pid

    state_file = Path(run_dir) / "stack.json"
    if not state_file.exists():
        return []
    stopped: list[str] = []
    for group in (("supervisor",), ("controller",), None):
        state = read_state(run_dir)
        for name, pid in state.get("pids", {}).items():
            if name in stopped or (name not in group if group else name in ("supervisor", "controller")):
                continue
            marker = "org.pytorch.serve.ModelServer" if name == "torchserve" else "recserve"
            if stop_pid(int(pid), marker, started=state.get("started_at", {}).get(name)):
                stopped.append(name)
    state_file.unlink(missing_ok=True)
    return stopped


def write_prometheus_targets(run_dir: str | Path, state: dict) -> Path:
    """``<run_dir>/prometheus-targets.json``: every /metrics endpoint of the stack in Prometheus'
    file service discovery format (serving/stack/prometheus.yml reads it), labelled by component
    (``ps0.1`` -> ``ps``)."""
    from model_store import write_atomic

    groups = [
        {"targets": [address], "labels": {"component": name.rstrip("0123456789."), "instance_name": name}}
        for name, address in sorted(state.get("metrics_endpoints", {}).items())
    ]
    path = Path(run_dir) / "prometheus-targets.json"
    write_atomic(path, json.dumps(groups, indent=2).encode())
    return path
