"""docs/streaming.md's "Try it on one machine" block runs as printed: one bash script, from a
fresh directory, the venv's ``recserve`` and ``python`` first on PATH; then every sample of its 50
impressions of 200 items is joined (the counters its last line prints)."""

from __future__ import annotations

import urllib.request

import pytest

from tests.helpers import bash_block, doc_blocks, port_free, wait_until

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
    assert block[0].startswith("python -m loadtest.mockbroker") and len(block) == 6
    with bash_block(block, tmp_path) as proc:
        proc.wait(timeout=180)
        out = (tmp_path / "out.txt").read_text()
        assert proc.returncode == 0, out
        assert (
            'recserve_join_samples_total{label="negative"}' in out
            and "recserve_join_impressions_total" in out
        )
        wait_until(lambda: samples_joined() == 50 * 200, 120, "all 10,000 samples joined")
