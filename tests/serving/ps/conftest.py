"""Fixtures of the PS tests: a real training `recserve ps` process on free loopback ports."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest

from serving.ps.client import PSClient
from serving.rpc.auth import new_token_file
from tests.helpers import free_ports
from tests.serving.helpers import DIM


@contextlib.contextmanager
def _running_ps(log, *flags: str):
    """A training `recserve ps` (dim DIM) with an admin token (a 0600 file beside ``log``), a data
    root (``root`` beside ``log``) and a client holding the token; killed after."""
    port, metrics_port = free_ports(2)
    token, root = new_token_file(log.parent / "admin.token"), log.parent / "root"
    root.mkdir()
    cmd = [sys.executable, "-m", "recserve", "ps", "--port", str(port), "--metrics-port", str(metrics_port)]
    cmd += ["--admin-token-file", str(token), "--data-root", str(root)]
    with open(log, "w") as out:
        proc = subprocess.Popen([*cmd, "--dim", str(DIM), *flags], stdout=out, stderr=subprocess.STDOUT)
    client = PSClient(f"127.0.0.1:{port}", timeout_s=5.0, token_file=str(token))
    try:
        client.wait_ready(timeout_s=60)
        yield {"proc": proc, "client": client, "port": port, "metrics_port": metrics_port, "log": log,
               "root": root, "token": token}  # fmt: skip
    finally:
        client.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def training_ps(tmp_path_factory):
    """One training PS for a test module (capacity 1000, SGD at lr 0.5, rows initialised within
    +-0.1): a dict of its process, client, ports, log, data root and token file."""
    log = tmp_path_factory.mktemp("ps") / "ps.log"
    with _running_ps(
        log, "--capacity", "1000", "--optimizer", "sgd", "--lr", "0.5", "--init-scale", "0.1"
    ) as p:
        yield p


@pytest.fixture
def start_ps(tmp_path):
    """A training PS with a test's own flags: ``with start_ps("--capacity", "16") as p:`` (the same
    dict as ``training_ps``; its log is ``tmp_path / "ps.log"``)."""
    return lambda *flags: _running_ps(tmp_path / "ps.log", *flags)
