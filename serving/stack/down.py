"""``recserve down``: stop the processes a stack's state (stack.json, ``serving.stack.state``) lists,
in the order that keeps them stopped."""

from __future__ import annotations

from pathlib import Path

from serving.stack.state import StackState, read_state, remove_state, state_exists


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
