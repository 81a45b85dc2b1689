"""docs/hosts.md, "Running on several hosts": its serving lines run as printed, each on the host its comment
names -- three network namespaces with exactly the printed addresses (198.18.0.1-3), the model
store bound at /mnt/recserve on each -- and a request from another address scores like the trainer.
The PS shards refuse a write from another host."""

from __future__ import annotations

import os
import re
import shlex
import sys
import urllib.request
from pathlib import Path

import numpy as np
import orjson
import pytest

import model_store as ms
from serving.ps.client import PSClient, ShardError
from serving.scoring.client import ScoringClient, requests_from_file
from tests.helpers import ROOT, doc_blocks, exit_ok, recserve_argv, split_comment, wait_until
from tests.serving.helpers import TEST

pytestmark = pytest.mark.slow
MOUNT = "/mnt/recserve"


def block_lines(heading: str, n: int, block: int = 0) -> list[tuple[str, str]]:
    """(line, host comment) of docs/hosts.md's ``block``-th bash block under ``heading``."""
    out = [split_comment(line) for line in doc_blocks("docs/hosts.md", heading)[block]]
    assert len(out) == n and all(c for _, c in out), out
    return out


def _ping(address: str) -> bool:
    try:
        return urllib.request.urlopen(f"http://{address}:8080/ping", timeout=2).status == 200
    except OSError:
        return False


def _scores(address: str, store) -> np.ndarray:
    client = ScoringClient(f"http://{address}:8080/predictions/criteo",
                           key_file=str(store / ".run" / "criteo" / "serve-key_file.json"))  # fmt: skip
    scores = []
    for body, ctype in requests_from_file(TEST, "data/schemas/criteo.yaml", 200, 400):
        status, payload = client.post(body, ctype)
        assert status == 200, payload
        scores.extend(orjson.loads(payload)["scores"])
    return np.array(scores)


def test_the_serving_lines_run_as_printed_across_three_hosts(network, tmp_path, trained_copy):
    store = tmp_path / "store"
    trained_copy(store)
    net = network(3, ["host-a", "host-b", "host-c"], subnet="198.18.0")
    hosts = {"host A": net.hosts[0], "host B": net.hosts[1], "host C": net.hosts[2], "any host": net.hosts[0]}
    binds = {str(store): MOUNT}
    *servers, score = block_lines("Serving", 5)
    procs = []
    for i, (line, where) in enumerate(servers):
        host = hosts[where]
        assert shlex.split(line)[shlex.split(line).index("--host") + 1] == host.address, line
        log = tmp_path / f"{i}-{shlex.split(line)[1]}.log"
        procs.append((host.popen(recserve_argv(line), log, binds=binds, cwd=ROOT), log))

    def up() -> bool:
        _alive(procs)
        return _ping("198.18.0.3")

    wait_until(up, 120, "recserve serve on host C answering /ping 200")
    line, where = score
    done = hosts[where].run(
        recserve_argv(line), binds=binds, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count(": 200 scores") == 2, done.stdout  # --limit 400: two requests of 200
    assert '"dense": "1"' in done.stdout, done.stdout

    # from another address (this process, on the bridge): the trainer's own scores
    scores = _scores("198.18.0.3", store)
    offline = np.load(ms.version_dir(store, "criteo", "1") / "eval" / "scores.npy")[: len(scores)]
    assert np.abs(np.array(scores) - offline).max() <= 1e-6

    # a serving PS bound to a host's address takes no write from anyone
    with PSClient("198.18.0.1:50061", timeout_s=10) as ps:
        with pytest.raises(ShardError) as refused:
            ps.update(np.array([1], dtype=np.uint64), np.zeros((1, 16), dtype=np.float32))
    assert refused.value.code == "PERMISSION_DENIED", refused.value


def _alive(procs) -> None:
    for proc, log in procs:
        if proc.poll() is not None:
            raise AssertionError(f"{log.name} exited {proc.returncode}: {log.read_text()[-3000:]}")


def test_two_nodes_train_on_torchrun_against_ps_on_two_hosts_and_a_fifth_serves_it(network, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    net = network(5, ["host-a", "host-b", "host-c", "host-d", "host-e"], subnet="198.18.0")
    hosts = {f"host {c}": h for c, h in zip("ABCDE", net.hosts, strict=True)} | {
        "once, any host": net.hosts[0]
    }
    binds = {str(store): MOUNT}
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    token, ps_a, ps_b, node0, node1, serve = block_lines("Training on several nodes", 6)
    done = hosts[token[1]].run(
        ["sh", "-c", token[0]], binds=binds, cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and (store / "admin.token").stat().st_mode & 0o077 == 0, done.stderr
    shards = [(hosts[w].popen(recserve_argv(x), tmp_path / f"ps{i}.log", env=env, binds=binds, cwd=ROOT),
               tmp_path / f"ps{i}.log") for i, (x, w) in enumerate([ps_a, ps_b])]  # fmt: skip
    for address in ("198.18.0.1:50061", "198.18.0.2:50061"):
        with PSClient(address, timeout_s=10) as ps:
            ps.wait_connected(60)
    nodes = [(hosts[w].popen(shlex.split(x), tmp_path / f"node{i}.log", env=env, binds=binds, cwd=ROOT),
              tmp_path / f"node{i}.log") for i, (x, w) in enumerate([node0, node1])]  # fmt: skip
    exit_ok([(log.name, proc, log) for proc, log in nodes])
    _alive(shards)
    assert ms.current(store, "criteo") == "1"
    manifest = ms.read_manifest(ms.version_dir(store, "criteo", "1"))
    assert manifest.train is not None and manifest.train.world_size == 2, manifest.train
    assert (store / "criteo" / "checkpoints" / "step-20" / "ps" / "shard-1-of-2" / ms.SUCCESS).is_file()
    frontend = [(hosts[serve[1]].popen(recserve_argv(serve[0]), tmp_path / "serve.log", env=env, binds=binds,
                                       cwd=ROOT), tmp_path / "serve.log")]  # fmt: skip

    def up() -> bool:
        _alive(frontend)
        return _ping("198.18.0.5")

    wait_until(up, 120, "recserve serve on host E answering /ping 200")
    scores = _scores("198.18.0.5", store)
    offline = np.load(ms.version_dir(store, "criteo", "1") / "eval" / "scores.npy")[: len(scores)]
    assert np.abs(scores - offline).max() <= 1e-6


def test_a_job_without_ps_starts_its_shards_on_every_node_bound_to_the_node(network, tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    net = network(4, ["host-a", "host-b", "host-c", "host-d"], subnet="198.18.0")
    hosts = {"host C": net.hosts[2], "host D": net.hosts[3]}
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    lines = block_lines("Training on several nodes", 2, block=1)
    nodes = [(hosts[w].popen(shlex.split(x), tmp_path / f"node{i}.log", env=env, binds={str(store): MOUNT},
                             cwd=ROOT), tmp_path / f"node{i}.log") for i, (x, w) in enumerate(lines)]  # fmt: skip
    exit_ok([(log.name, proc, log) for proc, log in nodes])
    # shards 0 and 2 on C, 1 and 3 on D, each bound to its node's address
    for (_, log), node, shards, address in [
        (nodes[0], 0, "[0, 2]", "198.18.0.3"),
        (nodes[1], 1, "[1, 3]", "198.18.0.4"),
    ]:
        started = re.search(rf"node {node} started PS shards {re.escape(shards)} at (.*)", log.read_text())
        assert started, log.read_text()[-3000:]
        assert [a.rsplit(":", 1)[0] for a in started.group(1).split(", ")] == [address, address], (
            started.group(0)
        )
    manifest = ms.read_manifest(ms.version_dir(store, "job-shards", "1"))
    assert manifest.train is not None and manifest.train.world_size == 2
    assert manifest.train.config["num_shards"] == 4
    assert {p.name for p in (ms.version_dir(store, "job-shards", "1") / "embeddings").iterdir()} >= {
        f"shard-{i}-of-4" for i in range(4)
    }
