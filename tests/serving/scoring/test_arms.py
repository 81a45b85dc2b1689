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
def store(tmp_path_factory, trained_copy):
    """Version 1 published (CURRENT) and version 2 trained beside it (another seed)."""
    root = tmp_path_factory.mktemp("store")
    trained_copy(root)
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


# ---- what a split adds to a request: constant work (serving/scoring/arms.py) ---------------------
def _experiment(
    shares: list[float], shadows: int = 0, salt: str = "s", aborted: tuple[int, ...] = ()
) -> ex.Experiment:
    """A running record with candidates of ``shares`` laid out as ``ex.start`` does, ``shadows``
    shadow arms, and the candidates at ``aborted`` removed as ``ex.abort`` does (control takes
    their share)."""
    arms, offset = [], 0.0
    for i, share in enumerate(shares):
        arms.append(ex.Arm(chr(ord("A") + i), str(i + 2), share, offset=offset))
        offset += share
    arms += [ex.Arm(chr(ord("A") + len(shares) + i), str(9 + i), 0.0, shadow=True) for i in range(shadows)]
    gone = [arms[i] for i in aborted]
    control = ex.Arm(ex.CONTROL, "1", max(0.0, 1.0 - sum(shares)) + sum(a.share for a in gone))
    return ex.Experiment("e", salt, [control, *[a for a in arms if a not in gone]])


@pytest.mark.parametrize("shares, shadows, aborted", [([0.5], 0, ()), ([0.1, 0.1], 0, ()), ([0.2, 0.3, 0.1], 1, ()),
                                                      ([0.1, 0.1], 2, (0,)), ([1.0], 0, ()), ([0.25, 0.25], 0, (1,))])  # fmt: skip
def test_a_splits_assignment_is_model_stores_assign_one_key_at_a_time(shares, shadows, aborted):
    from serving.scoring.arms import Assignment

    exp = _experiment(shares, shadows, salt=f"salt-{len(shares)}-{shadows}", aborted=aborted)
    rng = np.random.default_rng(len(shares) + 10 * shadows)
    keys = [f"user-{i}" for i in range(3000)] + [str(int(x)) for x in rng.integers(0, 2**63, 3000)]
    keys += ["", "é", "ユーザー", "\U0001f600 emoji", "tab\tand space", "x" * 100, "trailing\0", "\0", "-17"]
    keys += ["".join(chr(int(c)) for c in rng.integers(1, 0xD7FF, int(n))) for n in rng.integers(1, 40, 500)]
    assert [Assignment(exp)(k) for k in keys] == ex.assign(keys, exp).tolist()


def test_an_ended_experiment_assigns_no_unit_one_key_at_a_time_either():
    from dataclasses import replace

    from serving.scoring.arms import Assignment

    with pytest.raises(ex.ExperimentError, match="assigns no unit"):
        Assignment(replace(_experiment([0.5]), state=ex.STOPPED))


def _reference_first_sign(batch, slot: int) -> int | None:
    """The unit's sign as ``CompactBatch.slot`` reads it (what ``first_sign`` reads in place)."""
    view = batch.slot(slot)
    if view.offsets is not None:
        lo, hi = int(view.offsets[0]), int(view.offsets[1])
        return int(view.signs[view.values[lo]]) if hi > lo else None
    return int(view.signs[view.values[0]]) if len(view.values) else None


def test_first_sign_reads_the_first_rows_value_of_any_slot_in_place():
    from features.batch import CompactBatch, SlotView
    from serving.scoring.arms import first_sign

    rng = np.random.default_rng(3)
    for trial in range(200):
        rows, slots = int(rng.integers(1, 6)), []
        for s in range(int(rng.integers(1, 7))):
            kind = rng.choice(["single", "context", "multi"])
            signs = np.unique(
                rng.integers(1, 2**62, int(rng.integers(1, 5)), dtype=np.uint64) | np.uint64(s << 58)
            )
            if kind == "multi":
                counts = rng.integers(0, 3, rows)
                offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.uint32)
                values = rng.integers(0, len(signs), int(offsets[-1])).astype(np.uint32)
                slots.append(SlotView(signs, values, offsets, False))
            else:
                n = 1 if kind == "context" else rows
                slots.append(
                    SlotView(signs, rng.integers(0, len(signs), n).astype(np.uint32), None, kind == "context")
                )
        batch = CompactBatch.from_slots(rows, slots, np.zeros((rows, 0), np.float32))
        for slot in range(len(slots)):
            assert first_sign(batch, slot) == _reference_first_sign(batch, slot), (trial, slot)


def test_a_split_stamps_the_requests_own_versions_without_copying_the_request(store, experiment, bodies):
    from serving.scoring.loop import Outcome, Pending, stamped

    frontend, _ = serving(store)
    try:
        frontend.step()
        split = frontend.follower.arms.split
        assert split is not None
        scorer, started = split.route(bodies[0], JSON, "user-1", None)
        assert isinstance(started, Pending)
        arm = experiment.names()[split.arm_of("user-1")]
        assert (
            started.inputs.versions["arm"] == arm and started.inputs.versions["experiment"] == experiment.name
        )
        assert one_version(started.inputs.versions) == {a.name: a.version for a in experiment.arms}[arm]
        failed = Outcome(None, ValueError("x"), {}, {"total": 0.0})
        assert stamped(failed, {"arm": "A"}).versions == {"arm": "A"} and failed.versions == {}
    finally:
        frontend.close()


def test_a_new_arms_scorer_is_warmed_with_the_routers_recent_requests_before_it_serves(
    store, bodies, monkeypatch
):
    from serving.scoring import experiments as se
    from serving.scoring.arms import RECENT

    frontend, app = serving(store)
    warmed: list[tuple[str, int, bool]] = []
    real = se.warm

    def spy(scorer, requests):
        warmed.append((scorer.dense_version, len(requests), frontend.follower.arms.split is None))
        n = real(scorer, requests)
        assert n == len(requests)  # every recent request scored by the new version
        return n

    monkeypatch.setattr(se, "warm", spy)
    try:
        for i, body in enumerate(bodies[: RECENT + 3]):
            assert call(app, body, f"r{i}")[0] == 200
        recent = frontend.router.recent()
        assert recent == [(b, JSON) for b in bodies[3 : RECENT + 3]]  # the last RECENT, oldest first
        ex.start(store, "criteo", "warmed", [("2", 0.5)], salt="s")
        frontend.step()
        assert warmed == [("2", RECENT, True)]  # the new arm's scorer only, before the split serves
        assert frontend.follower.arms.split is not None
        frontend.step()
        assert len(warmed) == 1  # the same record: nothing loads, nothing warms
        from serving.scoring.arms import warm

        assert warm(frontend.follower.arms.split.scorers[1], [(b"{not json", JSON), (bodies[0], JSON)]) == 1
    finally:
        frontend.close()
        ex.stop(store, "criteo")
