"""The sparse half of training: embedding PS shards plus the embedding worker the trainer uses.

Three ways to get shards (``open_cluster``):

- default: start ``num_shards`` PS processes (``recserve ps``) on free loopback ports, and stop
  them (SIGTERM, then SIGKILL) when the cluster is closed, also on error. Their writes (updates,
  inserting lookups, dumps) need an admin token: a fresh one in a 0600 file in the cluster's
  private temporary directory, passed to the shards (``--admin-token-file``) and used by every
  client here; their dumps must lie under ``data_root`` (the model-store root);
- ``addresses``: connect to running shards given in shard order (their shard/num_shards are
  checked against that order), with their admin token file (``token_file``);
- ``inprocess``: ``TableShard``s in this process behind ``InProcessShard`` (tests, benchmarks).

The worker is always an in-process ``EmbeddingWorker`` library object in the trainer (over
``PSClient``s or ``InProcessShard``s), not a ``recserve worker`` process: the trainer is its only
client, and the library saves one network hop (pooled embeddings and their gradients) per step.
With torchrun, every rank has its own worker over the same shards: given ones, or the job's own,
shard i started by the local rank 0 of node i mod N and bound to that node's address
(``training.job_shards``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import yaml

from features.schema import Schema
from serving.rpc.auth import new_token_file

if TYPE_CHECKING:
    from model_store.shards import ShardData
    from serving.ps.config import TableShardConfig
    from serving.ps.shard import TableShard
    from serving.worker.core import EmbeddingWorker, WorkerConfig
    from training.replicated import Replicated

log = logging.getLogger("recserve.train")


@dataclass
class Cluster:
    """A worker over its shards, and what is needed to dump and stop them."""

    worker: EmbeddingWorker | None
    num_shards: int
    stores: list[TableShard] = field(default_factory=list)  # in-process stores (inprocess mode)
    addresses: list[str] = field(default_factory=list)  # gRPC shards
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)  # shards we started
    log_dir: tempfile.TemporaryDirectory[str] | None = None
    token_file: str = ""  # the gRPC shards' admin token file
    replicated: Replicated | None = None
    """The trainer's replicated tables (the sharding plan's): written into the shards before
    every dump, so a dump holds every table whatever the plan."""

    ASSIGN_ROWS = 1 << 15  # rows per Assign call: (8 + 4 dim (1 + state)) bytes each, ~4 MiB at dim 16

    def dump(self, directory: str | Path, delta: bool = False) -> None:
        """Write every shard's full dump (or delta) as ``directory/shard-<i>-of-<n>/``."""
        directory = Path(directory).resolve()  # a PS process has its own working directory
        directory.mkdir(parents=True, exist_ok=True)
        if self.replicated is not None:
            self.push_replicated(self.replicated)
        for store in self.stores:
            store.dump_delta(directory) if delta else store.dump(directory)
        if self.addresses:
            from serving.ps.client import PSClient

            for address in self.addresses:
                with PSClient(address, token_file=self.token_file) as client:
                    client.dump(str(directory), delta=delta)

    def cut_deltas(self) -> list[ShardData] | None:
        """Every in-process store's rows changed since the last delta, cut in memory
        (``TableShard.cut_delta``) for ``write_deltas`` to write off the training thread; None with
        gRPC shards (a shard cuts its delta when told to dump it: ``dump``)."""
        if self.addresses:
            return None
        if self.replicated is not None:
            self.push_replicated(self.replicated)
        return [store.cut_delta() for store in self.stores]

    @staticmethod
    def write_deltas(directory: str | Path, deltas: list[ShardData]) -> None:
        """Write what ``cut_deltas`` took as ``directory/shard-<i>-of-<n>/``."""
        from model_store import shards

        Path(directory).mkdir(parents=True, exist_ok=True)
        for data in deltas:
            shards.write_shard(directory, data)

    def push_replicated(self, replicated: Replicated) -> int:
        """Write the replicated tables' rows changed since the last push into the shards that own
        them; returns the rows written. Rows that did not get there stay changed for the next push."""
        data = replicated.push()
        if not len(data.signs):
            return 0
        try:
            return self.assign(data.signs, data.rows, data.state)
        except BaseException:
            replicated.restore(data)
            raise

    def assign(self, signs: np.ndarray, rows: np.ndarray, state: dict[str, np.ndarray]) -> int:
        """Set rows and their optimizer state on the shards that own the signs (distinct), in
        chunks of ``ASSIGN_ROWS``; returns the rows written."""
        from serving.worker.shards import HashRouter

        parts = HashRouter(self.num_shards).split(signs)
        written = 0
        clients = []
        try:
            if self.addresses:
                from serving.ps.client import PSClient

                clients = [PSClient(a, token_file=self.token_file) for a in self.addresses]
            for i, p in enumerate(parts):
                idx = np.arange(len(signs)) if p is None else p
                for lo in range(0, len(idx), self.ASSIGN_ROWS):
                    chunk = idx[lo : lo + self.ASSIGN_ROWS]
                    st = {k: v[chunk] for k, v in state.items()}  # the optimizer's state order
                    if clients:
                        written += clients[i].assign(signs[chunk], rows[chunk], list(st.values()))
                    else:
                        written += self.stores[i].assign(signs[chunk], rows[chunk], st)
        finally:
            for c in clients:
                c.close()
        return written

    def load(self, directory: str | Path) -> int:
        """Replace every shard's rows and optimizer state with a full dump written by ``dump``
        (re-sharded if it has another shard count); returns the rows loaded over all shards."""
        directory = Path(directory).resolve()
        rows = sum(store.load(directory) for store in self.stores)
        if self.addresses:
            from serving.ps.client import PSClient

            for address in self.addresses:
                with PSClient(address, token_file=self.token_file) as client:
                    rows += int(client.load(str(directory)).rows)
        return rows

    def stats(self) -> dict[str, int]:
        """What the shards hold and what they dropped, summed over the shards: ``ps_rows``,
        ``evictions`` (the eviction policy), ``expired`` (the TTL) and ``grows``; and
        ``replicated_rows``, the trainer's replicated tables' (in the shards after a dump)."""
        per_shard = [store.stats() for store in self.stores]
        if self.addresses:
            from serving.ps.client import PSClient

            for address in self.addresses:
                with PSClient(address) as client:
                    per_shard.append(client.stats())
        keys = {"ps_rows": "rows", "evictions": "evictions", "expired": "expired", "grows": "grows"}
        out = {name: sum(int(st[key]) for st in per_shard) for name, key in keys.items()}
        out["replicated_rows"] = len(self.replicated) if self.replicated is not None else 0
        return out

    def expire(self) -> int:
        """Run the TTL on in-process stores (a PS process runs its own every expire_every_s)."""
        return sum(store.expire() for store in self.stores)

    def close(self) -> None:
        try:
            if self.worker is not None:
                self.worker.close()
        finally:
            stop_processes(self.procs)
            self.procs = []
            if self.log_dir is not None:
                self.log_dir.cleanup()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_cluster(
    schema: Schema,
    store: TableShardConfig,
    num_shards: int,
    worker_config: WorkerConfig | None,
    addresses: list[str] | None = None,
    inprocess: bool = False,
    token_file: str = "",
    data_root: str | Path = "",
) -> Cluster:
    """Shards (started, given or in-process) and an EmbeddingWorker over them; the shards we start
    have ``store``'s config (its shard and num_shards replaced by theirs). ``token_file``:
    the admin token file of the given ``addresses``; ``data_root``: where the shards we start may
    write dumps (the model-store root; "" = the shards' default, the default model-store root)."""
    from serving.worker.core import EmbeddingWorker, InProcessShard, connect

    if inprocess:
        from serving.ps.shard import TableShard

        stores = [TableShard(replace(store, shard=i, num_shards=num_shards)) for i in range(num_shards)]
        worker = EmbeddingWorker([InProcessShard(s) for s in stores], schema, worker_config)
        return Cluster(worker, num_shards, stores=stores)
    cluster = Cluster(None, 0, token_file=token_file)
    try:
        if not addresses:
            cluster.log_dir = tempfile.TemporaryDirectory(prefix="recserve-ps-")  # mode 0700
            log_dir = Path(cluster.log_dir.name)
            cluster.token_file = str(new_token_file(log_dir / "admin.token"))
            cluster.procs, addresses = start_shards(store, num_shards, log_dir, cluster.token_file, data_root)
        # connect() checks that shard i of len(addresses) answers at address i
        cluster.worker = connect(list(addresses), schema, worker_config, 30.0, cluster.token_file)
        cluster.addresses, cluster.num_shards = list(addresses), len(addresses)
        return cluster
    except BaseException:
        cluster.close()
        raise


# ---- PS processes -------------------------------------------------------------------------------
def start_shards(
    store: TableShardConfig, num_shards: int, log_dir: Path, token_file: str, data_root: str | Path = "",
    timeout_s: float = 60.0, shards: list[int] | None = None, host: str = "127.0.0.1",
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:  # fmt: skip
    """Start ``recserve ps`` processes for ``shards`` (default all, 0..n-1) of ``num_shards``, each
    configured with ``store`` (its YAML: the same nested config, shard and num_shards replaced),
    bound to ``host`` (loopback by default), and wait until all serve; their writes need the token
    in ``token_file``, their dumps must lie under ``data_root``. Each dies with the thread that
    started it. Returns the processes and their addresses, in the order of ``shards``."""
    from serving.rpc.procs import free_ports, spawn, wait_grpc_healthy

    shards = list(range(num_shards)) if shards is None else shards
    procs: list[subprocess.Popen[bytes]] = []
    addresses = [f"{host}:{p}" for p in free_ports(len(shards), host)]
    try:
        for i, address in zip(shards, addresses, strict=True):
            cfg = log_dir / f"ps-{i}.yaml"
            mine = asdict(replace(store, shard=i, num_shards=num_shards))
            shard = {"server": {"grace_s": 0.5}, "admin_token_file": str(token_file), "store": mine}
            if data_root:
                shard["data_root"] = str(Path(data_root).resolve())
            cfg.write_text(yaml.safe_dump(shard))  # a TrainingShardConfig
            port = address.rsplit(":", 1)[1]
            args = ["ps", "--config", str(cfg), "--host", host, "--port", port, "--log-level", "WARNING"]
            procs.append(spawn(args, log_dir / f"ps-{i}.log", env=_child_env(), die_with_parent=True))
        for i, address, proc in zip(
            shards, addresses, procs, strict=True
        ):  # one wait; an early exit shows its log
            wait_grpc_healthy(address, timeout_s, proc, log_dir / f"ps-{i}.log")
        return procs, addresses
    except BaseException:
        stop_processes(procs)
        raise


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "") if env.get("PYTHONPATH") else root
    return env


def stop_processes(procs: list[subprocess.Popen[bytes]], timeout_s: float = 10.0) -> None:
    """Stop every process we started (``serving.rpc.procs``: SIGTERM, SIGKILL after ``timeout_s``)."""
    from serving.rpc.procs import stop_children

    stop_children(procs, timeout_s)
