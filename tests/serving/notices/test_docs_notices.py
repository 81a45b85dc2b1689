"""docs/serving.md's "Update notices" block runs as printed: one bash script in a fresh directory
holding the trained store as ``artifacts/`` and the repository's ``data/``, the venv first on PATH;
the PS shard (poll 600 s) applies the trainer's delta at its Kafka notice."""

from __future__ import annotations

import re
import shutil

import pytest

from tests.helpers import ROOT, bash_block, doc_blocks, port_free

DOC, HEADING, PORTS = "docs/serving.md", "Update notices", (50081, 9479)


@pytest.mark.slow
def test_the_notices_lines_run_as_printed(tmp_path, trained):
    if not all(port_free(p) for p in PORTS):
        pytest.skip(f"ports {PORTS} (the guide's) are taken")
    (block,) = doc_blocks(DOC, HEADING)
    assert block[0].startswith("python -m loadtest.mockbroker") and len(block) == 8
    shutil.copytree(trained[0], tmp_path / "artifacts")
    (tmp_path / "data").symlink_to(ROOT / "data")
    with bash_block(block, tmp_path) as proc:
        proc.wait(timeout=300)
        out = (tmp_path / "out.txt").read_text()
        assert proc.returncode == 0, out + (tmp_path / "ps.log").read_text()[-3000:]
        ok = re.search(r'^recserve_notices_total\{outcome="ok",transport="kafka"\} (\S+)$', out, re.M)
        assert ok and float(ok.group(1)) >= 1, out  # each delta the trainer cut was announced and received
        assert 'recserve_notices_total{outcome="malformed",transport="kafka"} 0.0' in out, out
        assert re.search(
            r'^recserve_delta_visible_seconds\{component="ps",seq="\d+",shard="0",version="1"\}', out, re.M
        ), out
