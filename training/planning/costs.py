"""What the sharding planner (``training.planning.planner``) weighs: per-ID and per-call costs of a table
in process and on the PS (``Costs``), measured here by ``measure_costs`` or the dev VM's
defaults, and what talking to the PS at all costs a step (``round_trips_us``)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Costs:
    """Per-step cost figures of the two placements (microseconds; GB/s)."""

    local_us_per_id: float = 0.40
    """In-process lookup (inserting) + sparse update of one row in an TableShard."""
    rpc_us_per_id: float = 1.36
    """The same through a PS process over gRPC (encode, send, store, answer), per ID."""
    rpc_us_per_call: float = 906.0
    """One RPC round trip (a lookup, an update, or both in one ``UpdateLookup``) whatever its size."""
    allgather_gbps: float = 1.0
    """Bytes per second (1e9) between nodes for the replicated tables' gradient all-gather."""
    local_path: float = 1.95
    """The trainer's replicated path per ID over the store's own time (``local_us_per_id``):
    the all-replicated ``--profile`` run spent 0.78 us per ID in its replicated phase (1.23 ms for
    1,574 IDs; masks, the table's assembly and the data reader's thread beside it) against 0.40
    timed on the store alone. Fitted on the 2-vCPU dev VM, like ``rpc_exposed``."""
    rpc_exposed: float = 0.27
    """Share of a PS table's per-ID time a step still waits for when the next batch's lookup is
    prefetched during the dense step and updates are pushed without waiting (``--staleness`` >= 1;
    without prefetch the step waits for all of it). Fitted to ``--profile`` runs on the 2-vCPU dev
    VM (300k synth rows, 1 and 2 shards: all on the PS vs all replicated vs half): beyond the
    round trips (1.56 ms per shard, from the 1- and 2-shard runs), the PS runs' steps cost 0.36
    us per ID over the replicated run's pool and dense, of 1.36 measured per ID. Checked again
    once a step's lookup and update became one ``UpdateLookup``: estimated 1.48 / 2.39 ms per
    step (every table on the PS, 1 / 2 shards) against 1.24 / 2.70 measured over the replicated
    run's pool and dense; 21 small tables replicated, 1.93 / 2.84 against 1.85 / 2.81."""
    source: str = "defaults (the median of 5 `recserve plan` measurements on the 2-vCPU dev VM)"
    """Where the figures come from: measured here, or the defaults."""


def round_trips_us(costs: Costs, num_shards: int, prefetch: bool = True) -> float:
    """What a step pays for talking to the PS at all, per shard: one round trip with prefetch (a
    step's update goes with the lookup of the batch after next, ``UpdateLookup``), a lookup and
    an update without."""
    return (1 if prefetch else 2) * num_shards * costs.rpc_us_per_call


def measure_costs(store, ids: int = 4096, reps: int = 20) -> Costs:
    """Time lookup + update of ``ids`` random signs in an in-process store and through a PS
    process started here (``store``: the shards' TableShardConfig), and one-sign round trips."""
    import tempfile

    from serving.ps.client import PSClient
    from serving.ps.shard import TableShard
    from serving.rpc.auth import new_token_file
    from training.cluster import start_shards, stop_processes

    rng = np.random.default_rng(0)
    batches = [rng.integers(1, 1 << 62, ids, dtype=np.uint64) for _ in range(reps)]
    grads = rng.standard_normal((ids, store.dim)).astype(np.float32) * 1e-3
    inproc = TableShard(store)

    def per_id(lookup, update) -> float:
        lookup(batches[0]), update(batches[0])  # warm
        t0 = time.perf_counter()
        for signs in batches:
            lookup(signs)
            update(signs)
        return (time.perf_counter() - t0) / (reps * ids) * 1e6

    local = per_id(lambda s: inproc.rows_of(s, True), lambda s: inproc.apply_gradients(s, grads))
    with tempfile.TemporaryDirectory(prefix="recserve-plan-") as tmp:
        token = str(new_token_file(Path(tmp) / "admin.token"))
        procs, (address,) = start_shards(store, 1, Path(tmp), token, tmp)
        try:
            with PSClient(address, token_file=token) as client:
                client.wait_ready()
                rpc = per_id(lambda s: client.lookup(s, insert=True), lambda s: client.update(s, grads))
                one = batches[0][:1]
                client.lookup(one)
                t0 = time.perf_counter()
                for _ in range(reps * 5):
                    client.lookup(one)
                call = (time.perf_counter() - t0) / (reps * 5) * 1e6
        finally:
            stop_processes(procs)
    return Costs(round(local, 3), round(max(rpc - 2 * call / ids, 0.0), 3), round(call, 1),
                 source=f"measured on {os.uname().nodename} ({os.cpu_count()} CPUs)")  # fmt: skip
