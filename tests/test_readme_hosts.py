"""README "Running on several hosts": its serving lines run as printed, each on the host its comment
names -- three network namespaces with exactly the printed addresses (198.18.0.1-3), the model
store bound at /mnt/recserve on each -- and a request from another address scores like the trainer.
The PS shards refuse a write from another host."""

from __future__ import annotations

import re
import shlex
import urllib.request

import numpy as np
import orjson
import pytest

import model_store as ms
from serving.ps.client import PSClient, ShardError
from serving.scoring.client import ScoringClient, requests_from_file
from tests.helpers import ROOT, recserve_argv, train_version, wait_until
from tests.serving.helpers import TEST

pytestmark = pytest.mark.slow
MOUNT = "/mnt/recserve"


def serving_lines() -> list[tuple[str, str]]:
    """(line, host comment) of the README's `### Serving` block under "Running on several hosts"."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Running on several hosts\n.*?### Serving\n.*?```bash\n(.*?)```", text, re.S).group(
        1
    )
    out = []
    for raw in block.splitlines():
        line, _, comment = raw.partition("  #")
        out.append((line.strip(), comment.strip()))
    assert len(out) == 5 and all(c for _, c in out), out
    return out


def test_the_serving_lines_run_as_printed_across_three_hosts(network, tmp_path):
    store = tmp_path / "store"
    train_version(store, seed=0, publish=True)
    net = network(3, ["host-a", "host-b", "host-c"], subnet="198.18.0")
    hosts = {"host A": net.hosts[0], "host B": net.hosts[1], "host C": net.hosts[2], "any host": net.hosts[0]}
    binds = {str(store): MOUNT}
    *servers, score = serving_lines()
    procs = []
    for i, (line, where) in enumerate(servers):
        host = hosts[where]
        assert shlex.split(line)[shlex.split(line).index("--host") + 1] == host.address, line
        log = tmp_path / f"{i}-{shlex.split(line)[1]}.log"
        procs.append((host.popen(recserve_argv(line), log, binds=binds, cwd=ROOT), log))

    def up() -> bool:
        for proc, log in procs:
            if proc.poll() is not None:
                raise AssertionError(f"{log.name} exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            return urllib.request.urlopen("http://198.18.0.3:8080/ping", timeout=2).status == 200
        except OSError:
            return False

    wait_until(up, 120, "recserve serve on host C answering /ping 200")
    line, where = score
    done = hosts[where].run(
        recserve_argv(line), binds=binds, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.count(": 200 scores") == 2, done.stdout  # --limit 400: two requests of 200
    assert '"dense": "1"' in done.stdout, done.stdout

    # from another address (this process, on the bridge): the trainer's own scores
    client = ScoringClient("http://198.18.0.3:8080/predictions/criteo",
                           key_file=str(store / ".run" / "criteo" / "serve-key_file.json"))  # fmt: skip
    scores = []
    for body, ctype in requests_from_file(TEST, "data/schemas/criteo.yaml", 200, 400):
        status, payload = client.post(body, ctype)
        assert status == 200, payload
        scores.extend(orjson.loads(payload)["scores"])
    offline = np.load(ms.version_dir(store, "criteo", "1") / "eval" / "scores.npy")[: len(scores)]
    assert np.abs(np.array(scores) - offline).max() <= 1e-6

    # a serving PS bound to a host's address takes no write from anyone
    with PSClient("198.18.0.1:50061", timeout_s=10) as ps:
        with pytest.raises(ShardError) as refused:
            ps.update(np.array([1], dtype=np.uint64), np.zeros((1, 16), dtype=np.float32))
    assert refused.value.code == "PERMISSION_DENIED", refused.value
