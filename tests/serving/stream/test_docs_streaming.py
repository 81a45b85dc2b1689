"""docs/streaming.md's "Try it on one machine" block runs as printed: one bash script, from a
fresh directory, the venv's ``recserve`` and ``python`` first on PATH; then every sample of its 50
impressions of 200 items is joined (the counters its last line prints)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from tests.helpers import ROOT, doc_blocks, port_free, wait_until

DOC, HEADING, PORT = "docs/streaming.md", "Try it on one machine", 9477


def samples_joined() -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=5).read().decode()
    return sum(
        float(ln.split()[-1]) for ln in body.splitlines() if ln.startswith("recserve_join_samples_total{")
    )


@pytest.mark.slow
def test_the_try_it_lines_run_as_printed(tmp_path):
    if not port_free(PORT):
        pytest.skip(f"port {PORT} (the guide's metrics port) is taken")
    (block,) = doc_blocks(DOC, HEADING)
    assert block[0].startswith("python -m serving.stream.mockbroker") and len(block) == 6
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    with open(tmp_path / "out.txt", "w") as log:  # a file: the block's background jobs keep it open
        proc = subprocess.Popen(["bash", "-c", "\n".join(block)], cwd=tmp_path, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        proc.wait(timeout=180)
        out = (tmp_path / "out.txt").read_text()
        assert proc.returncode == 0, out
        assert (
            'recserve_join_samples_total{label="negative"}' in out
            and "recserve_join_impressions_total" in out
        )
        wait_until(lambda: samples_joined() == 50 * 200, 120, "all 10,000 samples joined")
    finally:
        with contextlib.suppress(ProcessLookupError):  # the broker, the joiner and the users it started
            os.killpg(proc.pid, signal.SIGKILL)  # (the broker gone, the others would wait on it a while)
        proc.wait()
