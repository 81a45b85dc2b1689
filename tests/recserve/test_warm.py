"""``recserve warm`` (README.md, "Starting warm", run as printed): into a numba cache of its own, as
the image holds one (``NUMBA_CACHE_DIR``, ``NUMBA_CPU_NAME=generic``), it compiles every kernel
``recserve serve`` starts with (and the streaming trainer's decode): the frontend then starts, takes
two workers' requests and compiles nothing (a kernel compiled would be a new file in the cache, or
a rewritten index)."""

from __future__ import annotations

import http.client
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.processes import http_ok
from tests.helpers import ROOT, doc_blocks, free_port, wait_until

pytestmark = pytest.mark.slow
BODY = json.dumps([{"C1": "68fd1e64", "I1": 1}]).encode()


def cache_files(root: Path) -> dict[str, int]:
    """Every file of the numba cache at ``root``: path -> mtime (ns)."""
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_a_cache_recserve_warm_filled_holds_every_kernel_serve_starts_with(trained, tmp_path):
    cache = tmp_path / "numba"
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache), "NUMBA_CPU_NAME": "generic"}
    ((line,),) = doc_blocks("README.md", "Starting warm")
    argv = shlex.split(line.split("#")[0])
    assert argv == ["recserve", "warm"]
    done = subprocess.run([sys.executable, "-m", "recserve", *argv[1:]], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "numba's cache is warm" in done.stderr and str(cache) in done.stderr
    warm = cache_files(cache)
    assert any(name.endswith(".nbc") for name in warm), warm  # compiled kernels, not only indexes
    # and the streaming trainer's decode (recserve train --stream's first consume)
    assert {"gather_rows", "dedup_spans"} <= {
        k for k in ("gather_rows", "dedup_spans") for n in warm if f".{k}-" in n
    }

    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "recserve", "serve", "--workers", "2", "--store", str(trained[0]),
                              "--port", str(port), "--no-token-auth"], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        serves = http_ok(f"http://127.0.0.1:{port}/ping")
        wait_until(lambda: serves() or serve.poll() is not None, 120, "recserve serve answering /ping")
        assert serve.poll() is None, serve.stdout.read() if serve.stdout else ""
        for _ in range(4):  # new connections: the kernel hands them to either worker
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("POST", "/predictions/criteo", BODY, {"Content-Type": "application/json"})
            assert conn.getresponse().status == 200
            conn.close()
    finally:
        serve.terminate()
        serve.wait(60)
    assert cache_files(cache) == warm, "recserve serve compiled kernels recserve warm had not"
