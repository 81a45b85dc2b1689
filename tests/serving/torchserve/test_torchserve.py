"""Integration: a real TorchServe on loopback, driven through serving.torchserve."""

import json
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

from serving.torchserve import (
    ManagementClient,
    TorchServe,
    TorchServeError,
    archive,
)
from tests.serving.torchserve.helpers import make_config

pytestmark = pytest.mark.slow

HANDLER = Path(__file__).resolve().parent / "echo_handler.py"


@pytest.fixture(scope="module")
def model_store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ts")
    store = root / "store"
    for version, tag in (("1.0", "one"), ("2.0", "two")):
        extra = root / version / "echo.json"
        extra.parent.mkdir()
        extra.write_text(json.dumps({"tag": tag}))
        archive(HANDLER, [extra], "echo", version, store)
    return store


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return [
        (c.laddr.ip, c.laddr.port)
        for p in procs
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]


def predict(ts: TorchServe, version: str | None = None) -> dict:
    body = json.dumps({"id": 42, "payload": "x" * 1000}).encode()
    return json.loads(ts.inference().predict("echo", body, version=version))


def test_lifecycle_versions_and_token_auth(model_store, tmp_path):
    cfg = make_config(model_store, tmp_path / "run")
    with TorchServe(cfg) as ts:
        pid = ts.pid
        assert (tmp_path / "run" / "torchserve.pid").read_text().strip() == str(pid)
        assert sorted(listening_addresses(pid)) == sorted(
            ("127.0.0.1", p)
            for p in (
                cfg.inference_port,
                cfg.management_port,
                cfg.metrics_port,
                cfg.grpc_inference_port,
                cfg.grpc_management_port,
            )
        )

        # Token auth is on by default: the key file is in the run dir and a call without it is refused.
        assert ts.key_file.parent == (tmp_path / "run").resolve() and ts.key_file.exists()
        with pytest.raises(TorchServeError, match="Token"):
            ManagementClient(cfg.url(cfg.management_port)).list_models()
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(cfg.url(cfg.inference_port) + "/ping", timeout=10)

        mgmt = ts.management()
        mgmt.register("echo-1.0.mar", "echo", initial_workers=1, batch_size=4, max_batch_delay_ms=5)
        assert predict(ts) == {"version": "1.0", "tag": "one", "batch": 1, "bytes": 1025, "id": 42}

        mgmt.register("echo-2.0.mar", "echo", initial_workers=1)
        assert predict(ts)["tag"] == "one"  # registering does not change the default
        assert predict(ts, version="2.0")["tag"] == "two"
        mgmt.set_default("echo", "2.0")
        assert predict(ts) == {"version": "2.0", "tag": "two", "batch": 1, "bytes": 1025, "id": 42}

        mgmt.unregister("echo", "1.0")
        assert [d["modelVersion"] for d in mgmt.describe("echo", "all")] == ["2.0"]
        assert mgmt.list_models() == [{"modelName": "echo", "modelUrl": "echo-2.0.mar"}]
        with pytest.raises(TorchServeError) as err:
            predict(ts, version="1.0")
        assert err.value.status == 404
        with pytest.raises(TorchServeError) as err:  # API errors carry TorchServe's own message
            mgmt.register("missing.mar", "nope")
        assert err.value.status == 404 and "missing.mar" in err.value.message

        old = ts.inference().inference_token()
        mgmt.rotate_key("inference")  # keys expire; the key file's API key renews them
        assert ts.inference().inference_token() != old and predict(ts)["version"] == "2.0"

        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        assert len(procs) >= 2  # the JVM and at least one Python worker

    gone, alive = psutil.wait_procs(procs, timeout=10)
    assert alive == []
    assert not (tmp_path / "run" / "torchserve.pid").exists()


def test_token_auth_can_be_disabled(model_store, tmp_path):
    cfg = make_config(model_store, tmp_path / "run", disable_token_auth=True)
    with TorchServe(cfg) as ts:
        assert not ts.key_file.exists()
        with urllib.request.urlopen(cfg.url(cfg.inference_port) + "/ping", timeout=10) as resp:
            assert json.loads(resp.read())["status"] == "Healthy"
        assert ManagementClient(cfg.url(cfg.management_port)).list_models() == []
        pid = ts.pid
    assert not psutil.pid_exists(pid)
