"""`recserve up --tls` as a user types it: a local CA and certificates under the run dir (private
keys 0600), every PS shard and the worker on mTLS, and the stack scores as the trainer did; a
plaintext client or one without the stack's client certificate is refused; `recserve down` stops it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

from serving.ps.client import PSClient, ShardError
from serving.rpc.tls import ClientTLS
from serving.scoring.client import ScoringClient
from serving.stack import tls as stack_tls
from serving.stack.down import down
from serving.stack.state import read_state
from serving.stack.view import serving_view
from tests.helpers import ROOT
from tests.serving.helpers import score_all

pytestmark = pytest.mark.slow


def _recserve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recserve", *argv], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)  # fmt: skip


def test_up_tls_serves_scores_over_mtls_and_refuses_plaintext(trained, tmp_path):
    root, result = trained
    run_dir = tmp_path / "run"
    up = _recserve("up", "--store", str(root), "--model", "criteo", "--run-dir", str(run_dir), "--tls",
                   "--lookups", "remote", "--http-port", "0", "--management-port", "0", "--metrics-port", "0")  # fmt: skip
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        tls_dir = run_dir / "tls"
        assert f"TLS is ON for the PS shards and the worker: CA {tls_dir / 'ca.pem'}" in up.stdout
        assert f"clients must present {tls_dir / 'client.pem'} (mTLS)" in up.stdout
        assert stat.S_IMODE(tls_dir.stat().st_mode) == 0o700
        for key in ("server.key", "client.key"):
            assert stat.S_IMODE((tls_dir / key).stat().st_mode) == 0o600
        state = read_state(run_dir)

        client = ScoringClient(state.endpoint, key_file=state.key_file)  # handler -> worker over mTLS
        online = score_all(client, 400)
        client.close()
        offline = np.load(os.path.join(result.version_dir, "eval", "scores.npy"))[:400]
        assert np.abs(online - offline).max() <= 1e-5

        view = serving_view(run_dir)  # the stack's own tools read it over mTLS
        assert all("error" not in s for s in view["ps"]) and "error" not in view["worker"], view
        tls = stack_tls.client(state)
        for bad, match in ((None, "client speaks plaintext"), (ClientTLS(tls.ca), "client speaks TLS")):
            with PSClient(state.ps[0], timeout_s=5, tls=bad) as ps, pytest.raises(ShardError, match=match):
                ps.stats()
    finally:
        down(run_dir)
