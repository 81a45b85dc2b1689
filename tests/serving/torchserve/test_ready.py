"""serving.torchserve.ready against a real TorchServe: not ready with no model, nor while a worker's
handler is still initializing (when TorchServe's own /ping already says Healthy), ready once it
returns; a management API that does not answer is not ready, said so."""

import json
import os
from pathlib import Path

import pytest

from serving.torchserve import TorchServe, archive
from serving.torchserve.ready import main
from tests.helpers import free_ports, wait_until
from tests.serving.torchserve.helpers import make_config

pytestmark = pytest.mark.slow
HANDLER = Path(__file__).resolve().parent / "gated_handler.py"


def test_ready_only_once_the_handler_has_initialized(tmp_path, capsys):
    gate = tmp_path / "gate"
    os.mkfifo(gate)  # the handler's initialize holds until a byte comes through it
    (tmp_path / "gate.json").write_text(json.dumps({"gate": str(gate)}))
    archive(HANDLER, [tmp_path / "gate.json"], "gated", "1.0", tmp_path / "store")

    def ready(management: str) -> tuple[int, str]:
        code = main(["--management", management])
        return code, capsys.readouterr().out.strip()

    (closed,) = free_ports(1)
    code, said = ready(f"http://127.0.0.1:{closed}")
    assert code == 1 and said.startswith(f"the management API at http://127.0.0.1:{closed} did not answer")
    with TorchServe(make_config(tmp_path / "store", tmp_path / "run", disable_token_auth=True)) as ts:
        url = ts.cfg.url(ts.cfg.management_port)
        assert ready(url) == (1, "no model registered")
        ts.management().register("gated-1.0.mar", "gated", initial_workers=1, synchronous=False)
        wait_until((tmp_path / "gate.started").exists, 60, "the handler to start initializing")
        assert ts.inference().ping()["status"] == "Healthy"  # TorchServe's /ping: why this module exists
        code, said = ready(url)
        assert code == 1 and said.startswith("gated: worker ") and said.endswith(" UNLOADING"), said
        fd = os.open(gate, os.O_WRONLY | os.O_NONBLOCK)  # the handler holds its read end
        os.write(fd, b"1")
        os.close(fd)
        wait_until(
            lambda: ready(url) == (0, "ready: gated"), 30, "the probe to pass once initialize returned"
        )
