"""A scoring frontend serves its model's running experiment (serving/scoring/arms.py,
experiments.py, shadow.py): over a store with version 1 published and version 2 beside it, each
request is scored by its arm's version alone and named by its arm; a unit keeps its arm across
requests and processes; the shares hold; a malformed record or one naming an unknown version is
refused and counted while serving stays on the last good record; stopping the experiment returns
every request to CURRENT; a shadow arm's scores are logged as impressions of their own."""

from __future__ import annotations

import asyncio
import http.client
import json
import subprocess
import sys
import threading
import uuid

import numpy as np
import orjson
import pytest

from features.codec import encode
from model_store import experiments as ex
from serving.scoring.arms import Unit
from serving.scoring.asgi import App
from serving.scoring.client import requests_from_file
from serving.scoring.config import ScoringConfig
from serving.scoring.core import BINARY, JSON
from serving.scoring.lean import Frontend, ServeConfig
from serving.scoring.shadow import shadow_id
from tests.helpers import free_port, train_version, wait_until
from tests.serving.helpers import TEST

SCHEMA = "data/schemas/criteo.yaml"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Version 1 published (CURRENT) and version 2 trained beside it (another seed)."""
    root = tmp_path_factory.mktemp("store")
    train_version(root, seed=0, publish=True)
    train_version(root, seed=1, publish=False)
    return root


@pytest.fixture
def bodies():
    return [b for b, _ in requests_from_file(TEST, SCHEMA, 5, 200)]  # 40 JSON requests of 5 items


def serving(root, batch_wait_ms: float = 0.0, impressions: str = "") -> tuple[Frontend, App]:
    config = ServeConfig(store=str(root), disable_token_auth=True, batch_wait_ms=batch_wait_ms, drain_s=0.05,
                         scoring=ScoringConfig(lookups="colocated", notices="none", log_impressions=impressions))  # fmt: skip
    frontend = Frontend(config)
    assert frontend.step() == "1"
    return frontend, App(frontend)


def call(app: App, body: bytes, rid: str, ctype: str = JSON) -> tuple[int, dict]:
    """(status, JSON body) of one POST through the ASGI app with X-Request-Id ``rid``."""
    scope = {"type": "http", "method": "POST", "path": "/predictions/criteo",
             "headers": [(b"content-type", ctype.encode()), (b"x-request-id", rid.encode())]}  # fmt: skip
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(msg):
        sent.append(msg)

    asyncio.run(app(scope, receive, send))
    return sent[0]["status"], orjson.loads(sent[1]["body"])


def metrics(frontend: Frontend) -> str:
    from prometheus_client import generate_latest

    return generate_latest(frontend.registry).decode()


def one_version(v: dict) -> str:
    """The one version a response read (the dense model's, the embeddings', every shard's)."""
    assert v["embedding"] == v["dense"] and {name for name, _ in v["shards"]} == {v["dense"]}, v
    return v["dense"]


@pytest.fixture
def experiment(store):
    """A running experiment (control 1, candidate A = 2 at 50%, units by request id), stopped after."""
    exp = ex.start(store, "criteo", f"exp-{uuid.uuid4().hex[:6]}", [("2", 0.5)], salt="s")
    yield exp
    if (now := ex.read_experiment(store, "criteo")) is not None and now.running:
        ex.stop(store, "criteo")


@pytest.mark.parametrize("batch_wait_ms", [0.0, 1.0])
def test_each_request_is_scored_by_its_arms_version_alone_and_named(store, experiment, bodies, batch_wait_ms):
    frontend, app = serving(store, batch_wait_ms)
    try:
        frontend.step()
        version = {a.name: a.version for a in experiment.arms}
        rids = [f"user-{i}" for i in range(len(bodies))]
        arms = []
        for rid, body in zip(rids, bodies, strict=True):
            status, reply = call(app, body, rid)
            assert status == 200, reply
            v = reply["versions"]
            assert v["experiment"] == experiment.name and one_version(v) == version[v["arm"]], v  # 0 mixed
            arms.append(v["arm"])
        expected = np.array(experiment.names())[ex.assign(rids, experiment)]
        assert arms == expected.tolist()  # the one assignment, by request id
        again = [call(app, bodies[0], rid)[1]["versions"]["arm"] for rid in rids]
        assert again == arms  # a unit keeps its arm across requests
        assert set(arms) == {"control", "A"}
        counted = metrics(frontend)
        for arm in ("control", "A"):
            n = 2 * arms.count(arm)
            assert f'recserve_scoring_arm_requests_total{{arm="{arm}",status="200"}} {float(n)}' in counted
        assert 'recserve_scoring_arm_mapped_bytes{arm="A",version="2"}' in counted
    finally:
        frontend.close()


def test_shares_hold_roughly_and_a_failed_request_names_its_arm(store, experiment, bodies):
    frontend, app = serving(store)
    try:
        frontend.step()
        split = frontend.follower.arms.split
        assert split is not None
        keys = [f"u{i}" for i in range(4000)]
        share = np.mean([split.arm_of(k) == experiment.names().index("A") for k in keys])
        assert 0.45 < share < 0.55, share
        status, reply = call(app, b"{not json", "user-1")
        assert status == 400 and "malformed JSON" in reply["error"]
        arm = experiment.names()[split.arm_of("user-1")]
        assert f'recserve_scoring_arm_requests_total{{arm="{arm}",status="400"}} 1.0' in metrics(frontend)
    finally:
        frontend.close()


def test_a_unit_key_slot_keys_units_by_its_value_in_json_and_binary_alike(store, bodies):
    exp = ex.start(store, "criteo", "by-c1", [("2", 0.5)], unit_key="C1", salt="s")
    frontend, app = serving(store)
    try:
        frontend.step()
        split = frontend.follower.arms.split
        assert split is not None and split.unit.name == "C1"
        scorer = frontend.scorer
        assert scorer is not None
        seen: dict[str, str] = {}
        for i, body in enumerate(bodies):
            request = scorer.decode(body, JSON)
            key = split.unit.key(request, f"r{i}")
            assert key.isdigit()  # the slot's sign, not the request id
            arm = exp.names()[split.arm_of(key)]
            for rid, sent, ctype in ((f"r{i}", body, JSON), (f"b{i}", encode(request.batch), BINARY)):
                status, reply = call(app, sent, rid, ctype)
                assert status == 200 and reply["versions"]["arm"] == arm, reply
            assert seen.setdefault(key, arm) == arm
        missing = Unit("C1", scorer.schema)  # a request without the field: its request id
        assert missing.key(scorer.decode(b'[{"I1": 1}]', JSON), "rid-7") == "rid-7"
        with pytest.raises(ex.ExperimentError, match="no sparse slot"):
            Unit("user_id", scorer.schema)
    finally:
        frontend.close()
        ex.stop(store, "criteo")


def test_a_bad_record_is_refused_and_counted_once_and_serving_stays_on_the_last_good_one(
    store, experiment, bodies
):
    frontend, app = serving(store)
    path = store / "criteo" / ex.NAME
    good = path.read_bytes()
    try:
        frontend.step()
        split = frontend.follower.arms.split
        assert split is not None
        bad = dict(
            json.loads(good),
            arms=[*json.loads(good)["arms"][:1], {**json.loads(good)["arms"][1], "version": "9"}],
        )
        for record in (b"{not json", json.dumps(bad).encode()):  # malformed; an unknown version
            path.write_bytes(record)
            frontend.step()
            frontend.step()  # refused once: logged and counted once
            assert frontend.follower.arms.split is split
            status, reply = call(app, bodies[0], "user-3")
            assert status == 200 and reply["versions"]["experiment"] == experiment.name
        assert 'recserve_version_refusals_total{component="scorer",kind="experiment"} 2.0' in metrics(
            frontend
        )
        path.write_bytes(good)
        frontend.step()
        assert frontend.follower.arms.split is split  # the same record: nothing reloads
    finally:
        path.write_bytes(good)
        frontend.close()


def test_stopping_returns_every_request_to_control_and_closes_the_arms_scorers(
    store, experiment, bodies, monkeypatch
):
    frontend, app = serving(store)
    try:
        frontend.step()
        split = frontend.follower.arms.split
        assert split is not None
        candidate, closed = split.scorers[experiment.names().index("A")], []
        close = candidate.close
        monkeypatch.setattr(candidate, "close", lambda: closed.append(close()))
        ex.stop(store, "criteo")
        frontend.step()
        assert frontend.follower.arms.split is None
        for i, body in enumerate(bodies):
            status, reply = call(app, body, f"user-{i}")
            assert status == 200 and "arm" not in reply["versions"] and one_version(reply["versions"]) == "1"
        assert len(closed) == 1  # after its drain; control's (CURRENT's) scorer serves on
    finally:
        frontend.close()


@pytest.mark.slow
def test_a_shadow_arm_is_scored_off_the_response_path_and_logged_beside(store, kafka, bodies):
    topic = kafka.create_topic(f"imps-{uuid.uuid4().hex[:8]}")
    kafka.create_topic(f"{topic}.shadow")
    exp = ex.start(store, "criteo", "shadowed", [], shadows=["2"], salt="s")
    frontend, app = serving(store, impressions=f"kafka://{kafka.bootstrap}/{topic}")
    try:
        frontend.step()
        rids = [f"user-{i}" for i in range(5)]
        replies = {rid: call(app, body, rid)[1] for rid, body in zip(rids, bodies[: len(rids)], strict=True)}
        assert {r["versions"]["arm"] for r in replies.values()} == {"control"}  # a shadow serves no unit
        shadow = exp.arms[-1].name
        logged = {i.request_id: i for i in consume(kafka.bootstrap, topic, len(rids))}
        assert sorted(logged) == rids  # the joiner's topic: the served impressions only
        shadows = {i.request_id: i for i in consume(kafka.bootstrap, f"{topic}.shadow", len(rids))}
        assert sorted(shadows) == sorted(shadow_id(r, shadow) for r in rids)
        logged.update(shadows)
        for rid, reply in replies.items():
            served, shadowed = logged[rid], logged[shadow_id(rid, shadow)]
            assert served.arm == "control" and served.versions.dense == "1"
            assert np.array_equal(served.scores, np.asarray(reply["scores"], np.float32))
            assert (
                shadowed.arm == shadow and shadowed.versions.dense == "2" and shadowed.batch == served.batch
            )
            assert not np.allclose(shadowed.scores, served.scores)  # another model's scores
        counted = metrics(frontend)
        assert f'recserve_scoring_arm_requests_total{{arm="{shadow}",status="200"}} 5.0' in counted
        assert f'recserve_impressions_logged_total{{topic="{topic}.shadow"}} 5.0' in counted
    finally:
        frontend.close()
        ex.stop(store, "criteo")


def consume(bootstrap: str, topic: str, n: int) -> list:
    from tests.serving.helpers import consume_impressions

    return consume_impressions(bootstrap, topic, n)


@pytest.mark.slow
def test_a_unit_gets_the_same_arm_in_another_process(store, experiment, bodies, tmp_path):
    """`recserve serve` in a child process (polling every 0.2 s) and a frontend here agree."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "recserve", "serve", "--workers", "1", "--store", str(store), "--port", str(port), "--poll-s", "0.2",
         "--no-token-auth", "--notices", "none"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout or []), daemon=True).start()
    frontend, app = serving(store)
    try:
        frontend.step()
        rids = [f"user-{i}" for i in range(len(bodies))]
        here = [call(app, body, rid)[1]["versions"]["arm"] for rid, body in zip(rids, bodies, strict=True)]

        def there(rid: str, body: bytes) -> str | None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                conn.request("POST", "/predictions/criteo", body, {"Content-Type": JSON, "X-Request-Id": rid})
                resp = conn.getresponse()
                return (
                    orjson.loads(resp.read()).get("versions", {}).get("arm") if resp.status == 200 else None
                )
            except ConnectionError:
                return None
            finally:
                conn.close()

        wait_until(lambda: there(rids[0], bodies[0]) or proc.poll() is not None, 90, "the child serving arms")
        assert proc.poll() is None, "".join(log)
        assert [there(rid, body) for rid, body in zip(rids, bodies, strict=True)] == here
    finally:
        frontend.close()
        proc.kill()
        proc.wait(10)


def test_a_full_shadow_queue_drops_and_counts_per_arm_at_once():
    from serving.scoring.shadow import ShadowArm, Shadows

    shadows = Shadows(None, capacity=0)  # nothing is ever queued
    arms = [ShadowArm("B", None, {}), ShadowArm("C", None, {})]  # type: ignore[arg-type]
    for i in range(3):
        shadows.offer(arms, b"[{}]", JSON, f"r{i}")
    assert shadows.dropped == {"B": 3, "C": 3}  # counted on the request's thread, before it returns
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(shadows)
    assert 'recserve_scoring_shadow_dropped_total{arm="B"} 3.0' in generate_latest(registry).decode()
    shadows.close()


def test_a_promoted_arm_serves_on_as_current_without_loading_twice(store, tmp_path, bodies):
    import shutil

    root = tmp_path / "store"
    shutil.copytree(store, root)  # promotion publishes: the module's store keeps CURRENT 1
    exp = ex.start(root, "criteo", "promoted", [("2", 0.5)], salt="s")
    frontend, app = serving(root)
    try:
        frontend.step()
        split = frontend.follower.split
        assert split is not None
        candidate = split.scorers[exp.names().index("A")]
        ex.promote(root, "criteo", "A")
        assert frontend.step() == "2"
        assert frontend.scorer is candidate and frontend.follower.split is None  # taken over, not reloaded
        for i, body in enumerate(bodies[:5]):
            status, reply = call(app, body, f"user-{i}")
            assert status == 200 and "arm" not in reply["versions"] and one_version(reply["versions"]) == "2"
    finally:
        frontend.close()
