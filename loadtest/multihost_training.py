"""Training across nodes with a node's rank killed: the lines of docs/hosts.md "Training on several
nodes" in network namespaces (``loadtest/netns.py``): standalone PS shards on hosts A and B (the
admin token in the store every host mounts), ``torchrun --nnodes N --rdzv-backend c10d
--max-restarts 3 ... recserve train --checkpoint-every K --resume`` on hosts C and D.

``run`` trains once on fresh shards: uninterrupted, or with rank 1 (host D) SIGKILLed once
checkpoint ``kill_after`` exists, after which torchrun restarts every rank from the newest
checkpoint (the shards loaded from it too). ``measure`` gives the AUC of both and their
difference, and training samples/s on two nodes against one.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import tempfile
from pathlib import Path

from loadtest import netns
from loadtest.common import ROOT
from loadtest.processes import descendants, venv_env, wait_for
from serving.rpc.procs import cmdline

MOUNT = "/mnt/recserve"
PS_PORT = 50061
RDZV_PORT = 29400


def _rank_pid(rank: int, node: int) -> int | None:
    """The training process of global ``rank`` that torchrun (the process ``node``) started."""
    for pid in descendants(node):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        elastic = any(e.startswith(b"TORCHELASTIC_RUN_ID=") for e in env)  # a worker, not torchrun itself
        if elastic and f"RANK={rank}".encode() in env and "train" in cmdline(pid).split():
            return pid
    return None


def run(net: netns.Network, work: Path, nodes: int = 2, epochs: int = 2, every: int = 10,
        kill_after: int = 0, data: str = "", timeout_s: float = 900) -> dict:  # fmt: skip
    """One training run on fresh PS shards; returns the trainer's summary (node 0's) plus
    ``restarted`` (whether a rank was killed and the job resumed)."""
    a, b, c, d = net.hosts[:4]
    store = work / f"store-{nodes}-{kill_after}-{secrets.token_hex(3)}"
    store.mkdir(parents=True)
    (store / "admin.token").write_text(secrets.token_urlsafe(32))
    (store / "admin.token").chmod(0o600)
    binds = {str(store): MOUNT}
    procs = []
    try:
        for i, host in enumerate((a, b)):
            argv = ["recserve", "ps", "--host", host.address, "--port", str(PS_PORT), "--shard", str(i),
                    "--num-shards", "2", "--lr", "0.005", "--admin-token-file", f"{MOUNT}/admin.token",
                    "--data-root", MOUNT]  # fmt: skip
            log = work / f"{store.name}-ps{i}.log"
            procs.append((f"ps{i}", host.popen(argv, log, env=venv_env(), binds=binds, cwd=ROOT), log))
        from serving.ps.client import PSClient

        for host in (a, b):
            with PSClient(f"{host.address}:{PS_PORT}", timeout_s=10) as ps:
                ps.wait_connected(60)
        trainers = []
        for rank, host in enumerate((c, d)[:nodes]):
            argv = ["torchrun", "--nnodes", str(nodes), "--node-rank", str(rank), "--nproc-per-node", "1",
                    "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{c.address}:{RDZV_PORT}",
                    "-m", "recserve", "train", "--store", MOUNT, "--model", "criteo", "--epochs", str(epochs),
                    "--ps", f"{a.address}:{PS_PORT},{b.address}:{PS_PORT}", "--ps-token-file",
                    f"{MOUNT}/admin.token", "--checkpoint-every", str(every), "--resume", "--no-progress",
                    *(["--data", data] if data else [])]  # fmt: skip
            log = work / f"{store.name}-node{rank}.log"
            trainers.append(
                (f"node{rank}", host.popen(argv, log, env=venv_env(), binds=binds, cwd=ROOT), log)
            )
        restarted = False
        if kill_after:
            target = store / "criteo" / "checkpoints" / f"step-{kill_after}"
            wait_for(target.exists, timeout_s, f"checkpoint {target.name}", procs + trainers)
            pid = _rank_pid(1, trainers[1][1].pid)
            if pid is None:
                raise RuntimeError("rank 1's training process not found")
            os.kill(pid, signal.SIGKILL)
            restarted = True
        for name, proc, log in trainers:
            if proc.wait(timeout_s) != 0:
                raise RuntimeError(f"{name} exited {proc.returncode}: {Path(log).read_text()[-3000:]}")
        out = (work / f"{store.name}-node0.log").read_text()
        summary = json.loads([x for x in out.splitlines() if x.startswith('{"auc"')][-1])
        if restarted and "resumes at step" not in out:
            raise RuntimeError(f"the killed job did not resume from a checkpoint: {out[-3000:]}")
        return summary | {"restarted": restarted}
    finally:
        from serving.rpc.procs import stop_children

        stop_children([p for _, p, _ in procs], 10.0)


def measure(quick: bool = False) -> dict:
    """resume_auc_delta (rank 1 killed mid-epoch vs uninterrupted, same seed and data), and
    samples/s on 2 nodes vs 1 (Criteo's split, 2 epochs; ``quick``: 1 epoch, a checkpoint every 5
    steps, the kill after the second, no 1-node run (its figure None))."""
    epochs, every, kill_after = (1, 5, 10) if quick else (2, 10, 20)
    with (
        tempfile.TemporaryDirectory(prefix="recserve-multihost-train-") as tmp,
        netns.Network(4, ["ps-a", "ps-b", "node-c", "node-d"]) as net,
    ):
        work = Path(tmp)
        whole = run(net, work, epochs=epochs, every=every)
        killed = run(net, work, epochs=epochs, every=every, kill_after=kill_after)
        one = {"samples_per_s": None} if quick else run(net, work, nodes=1, epochs=epochs, every=every)
    return {
        "auc_uninterrupted": whole["auc"],
        "auc_resumed": killed["auc"],
        "resume_auc_delta": round(abs(whole["auc"] - killed["auc"]), 5),
        "train_samples_per_s_2_nodes": whole["samples_per_s"],
        "train_samples_per_s_1_node": one["samples_per_s"],
        "train_wall_s_2_nodes": whole["wall_s"],
        "train_wall_s_resumed": killed["wall_s"],
    }
