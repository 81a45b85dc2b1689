"""``ScoringMetrics`` over TorchServe's own metrics cache (built from the config recserve writes):
replies are queued on the request path and written as TorchServe metric lines by the flusher
thread, each reply's request count and stage times."""

from __future__ import annotations

import logging
import subprocess
import sys
from types import SimpleNamespace

from serving.scoring.errors import Reply
from serving.torchserve.metrics import REQUESTS, STAGES, ScoringMetrics, write_metrics_config
from tests.helpers import ROOT, wait_until

REPLY = Reply(200, b"{}", {"decode": 0.4, "worker": 0.9, "dense": 0.9, "encode": 0.1, "total": 2.3},
              {"dense": "3", "embedding": "3"})  # fmt: skip


def metrics(tmp_path, flush_s: float) -> ScoringMetrics:
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

    cache = MetricsCacheYamlImpl(str(write_metrics_config(tmp_path / "metrics.yaml")))
    cache.initialize_cache()
    return ScoringMetrics(
        SimpleNamespace(metrics=cache, model_name="criteo"), "3", ["colocated"], "onnx", flush_s
    )


def lines(caplog, name: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"[METRICS]{name}.")]


def test_replies_are_written_by_the_flusher_not_on_the_request_path(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    m = metrics(tmp_path, flush_s=3600)  # the thread will not flush during this test
    try:
        m.record(REPLY)
        m.record(REPLY._replace(status=400, timings={"total": 0.2}, versions={}))
        assert lines(caplog, REQUESTS) == [] and lines(caplog, STAGES) == []
        m.flush()
        requests = lines(caplog, REQUESTS)
        assert len(requests) == 2
        assert "status:200,dense_version:3,embedding_version:3" in requests[0]
        assert "status:400,dense_version:3,embedding_version:none" in requests[1]
        assert len(lines(caplog, STAGES)) == 6  # five stages of the scored reply, the total of the other
        m.flush()  # nothing queued: nothing written twice
        assert len(lines(caplog, REQUESTS)) == 2
    finally:
        m.close()


def test_the_flusher_writes_within_its_period_and_close_writes_the_rest(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    m = metrics(tmp_path, flush_s=0.05)
    m.record(REPLY)
    wait_until(lambda: lines(caplog, REQUESTS), 10, "the flusher's write", poll_s=0.01)
    m.record(REPLY)
    m.close()
    assert len(lines(caplog, REQUESTS)) == 2


def test_what_is_queued_when_the_worker_exits_is_written(tmp_path):
    """TorchServe never calls a handler's close: its worker ends with sys.exit once the frontend
    closes the socket. The replies still queued then are written at the interpreter's exit."""
    code = f"""
import logging, sys
from types import SimpleNamespace
from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl
from serving.scoring.errors import Reply
from serving.torchserve.metrics import ScoringMetrics, write_metrics_config
logging.basicConfig(stream=sys.stdout, format="%(message)s", level=logging.INFO)  # as the worker logs
cache = MetricsCacheYamlImpl(str(write_metrics_config(__import__("pathlib").Path({str(tmp_path)!r}) / "m.yaml")))
cache.initialize_cache()
m = ScoringMetrics(SimpleNamespace(metrics=cache, model_name="criteo"), "3", ["colocated"], "onnx", 3600)
m.record(Reply(200, b"{{}}", {{"total": 2.3}}, {{"dense": "3", "embedding": "3"}}))
sys.exit(1)  # what TorchServe's worker does when its socket closes
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr[-3000:]
    written = [line for line in run.stdout.splitlines() if line.startswith(f"[METRICS]{REQUESTS}.")]
    assert len(written) == 1 and "status:200,dense_version:3,embedding_version:3" in written[0], run.stdout


def test_the_dense_device_is_a_gauge_as_recserve_serve_exports_it(tmp_path, caplog):
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

    from serving.scoring.names import DENSE_DEVICE

    caplog.set_level(logging.INFO)
    cache = MetricsCacheYamlImpl(str(write_metrics_config(tmp_path / "metrics.yaml")))
    cache.initialize_cache()
    m = ScoringMetrics(SimpleNamespace(metrics=cache, model_name="criteo"), "3", ["colocated"], "cuda-graphs", 3600,
                       device="cuda")  # fmt: skip
    m.close()
    written = lines(caplog, DENSE_DEVICE)
    values = {
        line.split("device:")[1].split("|")[0]: line.split("Count:")[1].split("|")[0] for line in written
    }
    assert values == {"cpu": "0", "cuda": "1"}, written
