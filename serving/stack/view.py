"""``serving_view``: what the stack running from a run directory actually serves, asked of the
processes its state (stack.json, ``serving.stack.state``) lists (``recserve versions``)."""

from __future__ import annotations

from pathlib import Path

from serving.stack.metrics import lookup_modes
from serving.stack.state import read_state


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
