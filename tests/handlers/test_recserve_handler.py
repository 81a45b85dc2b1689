"""The TorchServe handler (handlers/recserve_handler.py) over a real Scorer of a trained version
(co-located lookups) and TorchServe's own request Context: a batch TorchServe hands it (a model
registered with ``batch_size`` > 1) runs the dense model once over the requests that were looked
up, and each request gets the reply it gets alone; a bad request in the batch gets its own 400
and costs the others nothing."""

from __future__ import annotations

import json
import sys

import orjson
import pytest
from ts.context import Context, RequestProcessor

from handlers.recserve_handler import RecserveHandler
from serving.scoring.client import requests_from_file
from tests.serving.helpers import TEST

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def handler(trained, tmp_path_factory):
    model_dir = tmp_path_factory.mktemp("mar")
    scoring = {"version_dir": str(trained[1].version_dir), "lookups": "colocated"}
    (model_dir / "scoring.json").write_text(json.dumps(scoring))
    switch_s = sys.getswitchinterval()
    sys.setswitchinterval(0.005)  # CPython's default
    h = RecserveHandler()
    try:
        h.initialize(Context("criteo", str(model_dir), {}, 8, None, "0"))
        h.switch_s = sys.getswitchinterval()  # type: ignore[attr-defined]
    finally:
        sys.setswitchinterval(switch_s)
    yield h
    assert h.scorer is not None
    h.scorer.close()


def test_a_worker_with_colocated_shards_hands_the_gil_over_every_half_millisecond(handler):
    """A request thread that gives the GIL up (numpy, torch) waits up to the switch interval to
    get it back from a co-located shard's follower in the middle of a merge: 0.5 ms, not 5."""
    from serving.priority import FOLLOW_SWITCH_S

    assert handler.scorer.lookup_modes == ["colocated", "colocated"]
    assert handler.switch_s == pytest.approx(FOLLOW_SWITCH_S) == 0.0005


def _context(n: int) -> Context:
    context = Context("criteo", "", {}, n, None, "0")
    context.request_processor = [RequestProcessor({"Content-Type": "application/json"}) for _ in range(n)]
    return context


def _handle(handler: RecserveHandler, bodies: list[bytes]) -> tuple[list[int], list[dict], list[str]]:
    """(statuses, JSON bodies, Server-Timing headers) of one batch, as TorchServe would send them."""
    context = _context(len(bodies))
    payloads = handler.handle([{"body": b} for b in bodies], context)
    statuses = [context.get_response_status(i)[0] for i in range(len(bodies))]
    timing = [context.get_response_headers(i)["Server-Timing"] for i in range(len(bodies))]
    return statuses, [orjson.loads(p) for p in payloads], timing


def test_a_batch_runs_the_dense_model_once_and_each_request_gets_its_own_reply(handler, monkeypatch):
    bodies = [b for b, _ in requests_from_file(TEST, "data/schemas/criteo.yaml", 50, 150)]  # 3 x 50 items
    alone = [_handle(handler, [b])[1][0]["scores"] for b in bodies]
    scorer, runs = handler.scorer, []
    predict = scorer.predict
    monkeypatch.setattr(scorer, "predict", lambda inputs: runs.append(len(inputs)) or predict(inputs))
    statuses, replies, timing = _handle(handler, bodies)
    assert runs == [3]  # one dense call over the three requests
    assert statuses == [200, 200, 200]
    assert [r["scores"] for r in replies] == [pytest.approx(a, abs=1e-6) for a in alone]
    assert all("dense;dur=" in t for t in timing)


def test_a_bad_request_in_a_batch_gets_its_400_and_the_others_are_scored(handler):
    good = [b for b, _ in requests_from_file(TEST, "data/schemas/criteo.yaml", 20, 40)]
    alone = [_handle(handler, [b])[1][0]["scores"] for b in good]
    statuses, replies, _ = _handle(handler, [good[0], b'{"items": [{"C1": ', good[1]])
    assert statuses == [200, 400, 200]
    assert "malformed JSON" in replies[1]["error"]
    assert [replies[0]["scores"], replies[2]["scores"]] == [pytest.approx(a, abs=1e-6) for a in alone]


def test_a_batch_of_refused_requests_only(handler):
    statuses, replies, _ = _handle(handler, [b"", b"[]"])
    assert statuses == [400, 400]
    assert all(r["error"] for r in replies)


def test_the_handler_logs_each_request_once_with_its_request_id(trained, kafka, tmp_path):
    """The request loop's impression log under TorchServe's handler, as under ``recserve serve``
    (tests/serving/scoring/test_impressions.py): X-Request-Id honoured, else generated and
    answered; each request logged once with the bytes it was scored on and its reply's scores."""
    from features.codec import encode
    from tests.serving.helpers import consume_impressions

    topic = kafka.create_topic("handler-imps")
    scoring = {"version_dir": str(trained[1].version_dir), "lookups": "colocated",
               "log_impressions": f"kafka://{kafka.bootstrap}/{topic}"}  # fmt: skip
    (tmp_path / "scoring.json").write_text(json.dumps(scoring))
    h = RecserveHandler()
    h.initialize(Context("criteo", str(tmp_path), {}, 8, None, "0"))
    assert h.scorer is not None and h.impressions is not None
    try:
        bodies = [b for b, _ in requests_from_file(TEST, "data/schemas/criteo.yaml", 20, 60)]
        context = _context(len(bodies))
        context.request_processor[0] = RequestProcessor({"Content-Type": "application/json",
                                                         "X-Request-Id": "client-0"})  # fmt: skip
        payloads = h.handle([{"body": b} for b in bodies], context)
        rids = [context.get_response_headers(i)["X-Request-Id"] for i in range(len(bodies))]
        assert rids[0] == "client-0" and all(len(r) == 32 for r in rids[1:]) and len(set(rids)) == 3
        logged = {imp.request_id: imp for imp in consume_impressions(kafka.bootstrap, topic, len(bodies))}
        assert sorted(logged) == sorted(rids)
        for rid, body, payload in zip(rids, bodies, payloads, strict=True):
            imp, reply = logged[rid], orjson.loads(payload)
            assert imp.batch == encode(h.scorer.decode(body, "application/json").batch)
            assert imp.scores.tolist() == pytest.approx(reply["scores"], abs=1e-7)
            assert (imp.versions.embedding, imp.versions.dense) == (reply["versions"]["embedding"],
                                                                    reply["versions"]["dense"])  # fmt: skip
    finally:
        h.impressions.close()
        h.scorer.close()


def test_a_handler_that_follows_the_model_serves_each_published_version_and_reports_a_refused_one(
    trained, tmp_path, caplog
):
    """scoring.json names the store instead of a version (components/torchserve's archive): before
    anything is published each request is a 503 naming why; the worker then serves what CURRENT
    names, and a newly published version without a restart, each batch answered by one version;
    a version the gate refuses is logged, counted on /metrics and skipped (the worker keeps serving
    what it has), and a worker that starts on it answers 503 naming the refusal."""
    import logging
    import shutil

    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

    import model_store as ms
    from serving.torchserve.metrics import REFUSALS, SERVED, write_metrics_config
    from tests.helpers import second_half, train_version, wait_until

    caplog.set_level(logging.INFO)
    root = tmp_path / "store"
    shutil.copytree(trained[0], root)
    (root / "criteo" / "CURRENT").unlink()  # nothing published yet
    model_dir = tmp_path / "mar"
    model_dir.mkdir()
    (model_dir / "scoring.json").write_text(json.dumps({"store": str(root), "drain_s": 0.1, "lookups": "colocated",
                                                        "poll_s": 0.2}))  # fmt: skip

    def started() -> RecserveHandler:
        cache = MetricsCacheYamlImpl(str(write_metrics_config(tmp_path / "metrics.yaml")))
        cache.initialize_cache()
        h = RecserveHandler()
        h.initialize(Context("criteo", str(model_dir), {}, 8, None, "0", metrics=cache))
        return h

    bodies = [b for b, _ in requests_from_file(TEST, "data/schemas/criteo.yaml", 20, 60)]
    h = started()
    try:
        statuses, replies = _handle(h, bodies[:2])[:2]
        assert statuses == [503, 503]
        assert all("no version published yet for model criteo" in r["error"] for r in replies), replies

        ms.publish(root, "criteo", "1")
        wait_until(lambda: _handle(h, bodies[:1])[0] == [200], 60, "version 1 served")
        train_version(root, seed=1, publish=False, data=second_half(tmp_path))  # version 2: other rows
        ms.publish(root, "criteo", "2", allow_schema_change=True)
        wait_until(lambda: h.scorer is not None and h.scorer.dense_version == "2", 60, "version 2 served")
        statuses, replies = _handle(h, bodies)[:2]
        assert statuses == [200] * 3
        assert {(r["versions"]["dense"], r["versions"]["embedding"]) for r in replies} == {("2", "2")}

        shutil.copytree(ms.version_dir(root, "criteo", "2"), ms.version_dir(root, "criteo", "3"))
        (ms.version_dir(root, "criteo", "3") / "_SUCCESS").unlink()  # never sealed: the gate says no
        ms.layout.set_current(root, "criteo", "3")  # forced past publish's gate
        assert h.follower is not None
        wait_until(lambda: h.follower.versions.is_refused("3"), 60, "version 3 refused")
        statuses, replies = _handle(h, bodies[:1])[:2]
        assert statuses == [200] and replies[0]["versions"]["dense"] == "2"  # it keeps serving what it has
        wait_until(lambda: any(r.getMessage().startswith(f"[METRICS]{REFUSALS}.") for r in caplog.records),
                   10, "the refusal on /metrics")  # fmt: skip
        served = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"[METRICS]{SERVED}.")]
        assert any("version:2" in line and "Count:1|" in line for line in served), served
        assert any("version:1" in line and "Count:0|" in line for line in served), served
    finally:
        assert h.follower is not None
        h.follower.close()

    h = started()  # a worker that starts while CURRENT names the refused version
    try:
        statuses, replies = _handle(h, bodies[:1])[:2]
        assert statuses == [503] and "version 3 refused" in replies[0]["error"], replies
    finally:
        assert h.follower is not None
        h.follower.close()


def test_a_handler_that_follows_the_model_serves_its_experiment_one_dense_run_per_arm(
    trained, tmp_path, caplog
):
    """The running experiment under TorchServe's handler, as under ``recserve serve``
    (tests/serving/scoring/test_arms.py): each request of a batch is scored by its arm's version
    alone and named by it, the dense model runs once per arm over the batch's requests, the arms'
    metrics are written; once stopped, every request goes to CURRENT again."""
    import logging
    import shutil

    import numpy as np
    from ts.metrics.metric_cache_yaml_impl import MetricsCacheYamlImpl

    from model_store import experiments as ex
    from serving.scoring.names import ARM_MAPPED, ARM_REQUESTS
    from serving.torchserve.metrics import write_metrics_config
    from tests.helpers import train_version, wait_until

    caplog.set_level(logging.INFO)
    root = tmp_path / "store"
    shutil.copytree(trained[0], root)
    train_version(root, seed=1, publish=False)  # version 2 beside CURRENT's 1
    exp = ex.start(root, "criteo", "handler", [("2", 0.5)], salt="s")
    model_dir = tmp_path / "mar"
    model_dir.mkdir()
    (model_dir / "scoring.json").write_text(json.dumps({"store": str(root), "drain_s": 0.1, "lookups": "colocated",
                                                        "poll_s": 0.2, "notices": "none"}))  # fmt: skip
    cache = MetricsCacheYamlImpl(str(write_metrics_config(tmp_path / "metrics.yaml")))
    cache.initialize_cache()
    h = RecserveHandler()
    h.initialize(Context("criteo", str(model_dir), {}, 8, None, "0", metrics=cache))
    assert h.follower is not None
    try:
        wait_until(lambda: h.follower.arms.split, 60, "the experiment served")
        split = h.follower.arms.split
        runs: list[str] = []
        for scorer in set(split.scorers):
            predict = scorer.predict
            scorer.predict = lambda inputs, p=predict, v=scorer.dense_version: runs.append(v) or p(inputs)
        bodies = [b for b, _ in requests_from_file(TEST, "data/schemas/criteo.yaml", 10, 80)]
        rids = [f"user-{i}" for i in range(len(bodies))]
        context = Context("criteo", "", {}, len(bodies), None, "0")
        context.request_processor = [RequestProcessor({"Content-Type": "application/json", "X-Request-Id": rid})
                                     for rid in rids]  # fmt: skip
        replies = [orjson.loads(p)["versions"] for p in h.handle([{"body": b} for b in bodies], context)]
        expected = np.array(exp.names())[ex.assign(rids, exp)].tolist()
        assert [v["arm"] for v in replies] == expected and set(expected) == {"control", "A"}
        version = {a.name: a.version for a in exp.arms}
        assert all(v["dense"] == v["embedding"] == version[v["arm"]] for v in replies), replies  # 0 mixed
        assert sorted(runs) == ["1", "2"]  # one dense run per arm
        h._metrics.flush()  # type: ignore[union-attr]
        written = [r.getMessage() for r in caplog.records if r.getMessage().startswith("[METRICS]")]
        assert any(m.startswith(f"[METRICS]{ARM_REQUESTS}.") and "arm:A,status:200" in m for m in written)
        assert any(m.startswith(f"[METRICS]{ARM_MAPPED}.") and "arm:A,version:2" in m for m in written)

        ex.stop(root, "criteo")
        wait_until(lambda: h.follower.arms.split is None, 60, "the experiment ended")
        again = [orjson.loads(p)["versions"] for p in h.handle([{"body": b} for b in bodies], context)]
        assert all("arm" not in v and v["dense"] == "1" for v in again), again
    finally:
        h.follower.close()
