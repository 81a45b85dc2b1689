"""The whole serving stack on loopback: a model trained on the Criteo split, real PS and worker
processes, real TorchServe with the recserve handler. Scores must equal the trainer's own; every
bad request gets its 4xx and the stack keeps scoring; a worker outage is a 503, not a hang."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import orjson
import pytest

from features import stream
from features.codec import encode
from features.readers import to_records
from features.schema import load_schema
from features.transform import transform
from serving.scoring.client import ScoringClient, requests_from_file
from serving.stack.down import down
from serving.stack.local import LocalStack, StackConfig
from tests.helpers import ROOT, gone, wait_until
from tests.serving.helpers import TEST, score_all

pytestmark = pytest.mark.slow
SCHEMA = load_schema("data/schemas/criteo.yaml")


@pytest.fixture(scope="module")
def stack(trained, start_stack):
    return start_stack(trained[0], "criteo")


@pytest.fixture
def client(stack):
    c = ScoringClient(stack.state.endpoint, key_file=stack.state.key_file)
    yield c
    c.close()


def test_everything_binds_loopback_and_token_auth_is_on_by_default(stack):
    assert all(a.startswith("127.0.0.1:") for a in [*stack.state.ps, stack.state.worker])
    assert stack.state.endpoint.startswith("http://127.0.0.1:")
    assert stack.state.token_auth
    status, payload = ScoringClient(stack.state.endpoint).post(b"[{}]")  # no token
    assert status in (400, 401) and b"Token Authorization failed" in payload, payload  # TorchServe says 400


def test_the_ps_shards_serve_mapped_versions(stack):
    from serving.ps.client import PSClient

    logs = Path(stack.state.run_dir) / "logs"
    assert len(stack.state.ps) == 2  # the version's two shards: the checks below run for each
    for i, target in enumerate(stack.state.ps):
        assert "serving mapped versions" in (logs / f"ps{i}.log").read_text()
        with PSClient(target) as ps:
            st = ps.stats()
        assert st["optimizer"] == "none" and st["rows"] > 0  # no optimizer state on a serving shard


def test_online_scores_equal_offline_scores(stack, client, trained):
    root, result = trained
    offline = np.load(os.path.join(result.version_dir, "eval", "scores.npy"))
    online = score_all(client)
    assert len(online) == len(offline) == 2000
    assert np.abs(online - offline).max() <= 1e-5


def test_binary_compact_batch_scores_like_json(client, trained):
    served_schema = os.path.join(trained[1].version_dir, "schema.yaml")  # binary clients build with it
    binary = score_all(client, 400, binary=True, schema=served_schema)
    assert np.abs(binary - score_all(client, 400)).max() <= 1e-6
    shipped = score_all(client, 400, binary=True)  # or with the shipped schema file: the same contract
    assert np.abs(shipped - binary).max() == 0


def test_score_binary_with_no_schema_flag_against_the_stack(stack, trained):
    """`recserve score --binary` as a user types it: the default schema is the shipped file, whose
    fingerprint is the served one (fitted statistics live in the model, not in the schema)."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "recserve", "score", TEST, "--binary", "--limit", "400",
            "--url", stack.state.endpoint, "--key-file", stack.state.key_file]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count(" 200 scores ") == 2, run.stdout


BAD = [
    (b'{"items": [', "application/json", 400, "malformed JSON"),
    (orjson.dumps([{"C1": "a", "bogus": 1}]), "application/json", 400, "unknown field"),
    (orjson.dumps([{"C1": {"x": 1}}]), "application/json", 400, "C1"),
    (orjson.dumps([{"I1": "not a number"}]), "application/json", 400, "I1"),
    (orjson.dumps([{}] * 1001), "application/json", 413, "exceed the limit"),
    (orjson.dumps({"items": "x"}), "application/json", 400, "items"),
    (b"garbage bytes", "application/octet-stream", 400, "invalid compact batch"),
    (b"RSCB" + bytes(60), "application/octet-stream", 400, "invalid compact batch"),
    (b"[{}]", "text/csv", 415, "unsupported content type"),
    (b"", "application/json", 400, "empty"),
]


@pytest.mark.parametrize(("body", "ctype", "status", "message"), BAD)
def test_bad_requests_get_4xx_and_the_stack_keeps_scoring(client, body, ctype, status, message):
    got, payload = client.post(body, ctype)
    assert got == status, payload
    assert message in orjson.loads(payload)["error"]
    ok, _ = client.post(orjson.dumps(to_records(stream.read(TEST, SCHEMA, limit=5), SCHEMA)))
    assert ok == 200


def test_binary_batch_for_another_schema_is_refused(client):
    obd = load_schema("data/schemas/obd.yaml")
    blob = encode(transform([{"item_id": "1"}], obd))
    status, payload = client.post(blob, "application/octet-stream")
    assert status == 400 and "schema" in orjson.loads(payload)["error"]


def test_worker_outage_is_a_503_not_a_hang_and_recovers(stack, client):
    pid = stack.state.pids["worker"]
    body = orjson.dumps(to_records(stream.read(TEST, SCHEMA, limit=3), SCHEMA))
    os.kill(pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        status, payload = client.post(body)
        assert status == 503, payload
        assert "worker" in orjson.loads(payload)["error"]
        assert time.monotonic() - t0 < 10
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_until(lambda: client.post(body)[0] == 200, 30, "scoring again once the worker runs")


def test_down_stops_exactly_what_up_started(trained, tmp_path):
    root, _ = trained
    cfg = StackConfig(store=str(root), model="criteo", run_dir=str(tmp_path / "run"),
                      http_port=0, management_port=0, metrics_port=0, disable_token_auth=True)  # fmt: skip
    s = LocalStack(cfg).start()
    try:
        pids = dict(s.state.pids)
        assert set(pids) == {"ps0", "ps1", "worker", "torchserve", "controller", "supervisor"}
        stopped = down(tmp_path / "run")  # as `recserve down` does, from the state file alone
        assert sorted(stopped) == sorted(pids)
        wait_until(lambda: all(gone(pid) for pid in pids.values()), 10, f"{sorted(pids)} gone")
    finally:
        s.stop()  # whatever `down` left (nothing when the test passes); reaps our children


def test_no_torchserve_starts_the_ps_shards_and_the_worker_alone_for_a_scorer_in_front(trained, tmp_path):
    # --no-torchserve: what recserve serve --lookups remote needs, as the Kubernetes manifests run it
    from serving.scoring.config import ScoringConfig
    from serving.scoring.core import JSON, Scorer
    from serving.scoring.loop import score

    root, result = trained
    cfg = StackConfig(store=str(root), model="criteo", run_dir=str(tmp_path / "run"), torchserve=False)
    s = LocalStack(cfg).start()
    try:
        pids = dict(s.state.pids)
        assert set(pids) == {"ps0", "ps1", "worker", "supervisor"} and s.state.endpoint == ""
        scorer = Scorer(ScoringConfig(result.version_dir, lookups="remote", worker=s.state.worker))
        try:
            body = next(iter(requests_from_file(TEST, "data/schemas/criteo.yaml", 200, 200)))[0]
            reply = score(scorer, body, JSON)
        finally:
            scorer.close()
        assert reply.status == 200 and reply.versions["embedding"] == s.state.version
        assert sorted(down(tmp_path / "run")) == sorted(pids)
        wait_until(lambda: all(gone(pid) for pid in pids.values()), 10, f"{sorted(pids)} gone")
    finally:
        s.stop()


def test_prometheus_evaluates_every_dashboard_query_and_alert_on_the_live_stack(
    trained, stack, client, prometheus, tmp_path, kafka
):
    """A real Prometheus scrapes every endpoint `up` lists in prometheus-targets.json, a
    `recserve serve` over the stack's worker, a trainer, a joiner, a streaming trainer and an
    experiment's watcher (over arm samples of its own topic), with deploy/prometheus/alerts.yml
    loaded: after its scrapes, every query of deploy/grafana/recserve.json and every alert's signal
    returns series, every alert expression evaluates, every rule is healthy."""
    import json
    import re
    import urllib.request

    from model_store import experiments as ex
    from serving.rpc.procs import spawn, stop_children
    from tests.deploy.helpers import dashboard_queries
    from tests.helpers import free_port
    from tests.stream.helpers import produce
    from tests.stream.watch.helpers import impressions, mixed, truthful

    targets = json.loads((Path(stack.run_dir) / "prometheus-targets.json").read_text())
    components = {g["labels"]["component"] for g in targets}
    assert components == {"ps", "worker", "controller", "torchserve"}, targets
    assert len([g for g in targets if g["labels"]["component"] == "ps"]) == len(stack.state.ps)
    port, train_port, join_port = free_port(), free_port(), free_port()
    for t in ("impressions", "events", "samples", "impressions.dead", "events.dead", "samples.quarantine"):
        kafka.create_topic(f"observed-{t}", 1)
    import shutil

    kafka.create_topic("observed-samples.dead", 1)
    follow_port = free_port()
    shutil.copytree(trained[0] / "criteo", tmp_path / "follow-store" / "criteo")  # a trainer of its own copy
    joiner = spawn(["join", "--brokers", kafka.bootstrap, "--impressions", "observed-impressions", "--events",
                    "observed-events", "--samples", "observed-samples", "--group", "observed",
                    "--metrics-port", str(join_port)], tmp_path / "join.log")  # fmt: skip
    follower = spawn(["train", "--follow", str(tmp_path / "follow-store" / "criteo"), "--stream",
                      f"kafka://{kafka.bootstrap}/observed-samples", "--metrics-port", str(follow_port)],
                     tmp_path / "follow.log")  # fmt: skip
    # an experiment on its own copy of the store, its watcher reading two arms' samples
    watch_port, watch_store = free_port(), tmp_path / "watch-store"
    shutil.copytree(trained[0] / "criteo", watch_store / "criteo")
    exp = ex.start(watch_store, "criteo", "observed", [(stack.state.version, 0.5)])
    arm_samples, rng = kafka.create_topic("observed-arm-samples", 1), np.random.default_rng(0)
    produce(kafka.bootstrap, arm_samples,
            mixed([impressions(arm, 50, exp.started + 1, rng, truthful) for arm in ("control", "A")], rng))  # fmt: skip
    watcher = spawn(["experiment", "watch", "--store", str(watch_store), "--model", "criteo", "--brokers",
                     kafka.bootstrap, "--samples", arm_samples, "--every-s", "1", "--metrics-port", str(watch_port)],
                    tmp_path / "watch.log")  # fmt: skip
    # a trainer with its metrics on, running all through the test (stopped at its end)
    trainer = spawn(["train", "--store", str(tmp_path / "train-store"), "--model", "metrics", "--inprocess-ps",
                     "--limit", "1024", "--epochs", "1000", "--checkpoint-every", "4", "--threads", "1",
                     "--no-export", "--no-progress", "--metrics-port", str(train_port)], tmp_path / "train.log")  # fmt: skip
    serve = spawn(["serve", "--workers", "1", "--store", str(trained[0]), "--model", "criteo",
                   "--port", str(port), "--lookups", "remote", "--worker", stack.state.worker, "--no-token-auth"],
                  tmp_path / "serve.log")  # fmt: skip
    try:
        lean = ScoringClient(f"http://127.0.0.1:{port}/predictions/criteo")
        wait_until(lambda: _ping(port), 60, f"recserve serve answering /ping (log: {tmp_path / 'serve.log'})")
        alerts = ROOT / "deploy" / "prometheus" / "alerts.yml"
        prom = prometheus({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(alerts)],
            "scrape_configs": [
                {"job_name": "recserve", "file_sd_configs": [{"files": [str(Path(stack.run_dir) / "prometheus-targets.json")], "refresh_interval": "1s"}]},
                {"job_name": "serve", "static_configs": [{"targets": [f"127.0.0.1:{port}"], "labels": {"component": "serve", "instance_name": "serve"}}]},
                {"job_name": "train", "static_configs": [{"targets": [f"127.0.0.1:{train_port}"], "labels": {"component": "train"}}]},
                {"job_name": "join", "static_configs": [{"targets": [f"127.0.0.1:{join_port}"], "labels": {"component": "join"}}]},
                {"job_name": "follow", "static_configs": [{"targets": [f"127.0.0.1:{follow_port}"], "labels": {"component": "follow"}}]},
                {"job_name": "watch", "static_configs": [{"targets": [f"127.0.0.1:{watch_port}"], "labels": {"component": "watch"}}]},
            ],
        })  # fmt: skip
        score_all(client, 400)
        score_all(lean, 400)
        assert client.post(b"{not json", "application/json")[0] == 400
        assert lean.post(b"{not json", "application/json")[0] == 400
        expected = sum(len(g["targets"]) for g in targets) + 5  # serve, 2 trainers, joiner, watcher
        wait_until(lambda: len(prom.query("up == 1")) == expected, 60, f"{expected} targets up in prometheus")
        wait_until(
            lambda: prom.query('recserve_scoring_requests_total{status="400"}'), 60, "the 400s scraped"
        )
        wait_until(
            lambda: prom.query("min(count_over_time(up[1m])) >= 3"), 60, "three scrapes of every target"
        )
        wait_until(lambda: prom.query("max(recserve_train_auc) > 0 and max(recserve_train_checkpoint_step) > 0"),
                   120, f"the trainer's first evaluation and checkpoint scraped (log: {tmp_path / 'train.log'})")  # fmt: skip

        wait_until(lambda: prom.query("min(count_over_time(recserve_experiment_samples_total[1m])) >= 2"), 60,
                   f"two scrapes of the watcher's arms (log: {tmp_path / 'watch.log'})")  # fmt: skip
        exprs = dashboard_queries()
        assert len(exprs) >= 15, exprs
        counts = {e: len(prom.query(e)) for e in exprs}
        print("\n".join(f"{n:3d} series  {e}" for e, n in counts.items()))  # for `pytest -s`
        empty = [e for e, n in counts.items() if not n]
        assert not empty, f"dashboard queries with no series on a live stack: {empty}"
        served = {
            r["metric"]["version"]
            for r in prom.query("recserve_ps_version == 1 or recserve_scoring_version == 1")
        }
        assert served == {stack.state.version}, served
        modes = {(r["metric"]["component"], r["metric"]["shard"], r["metric"]["mode"])
                 for r in prom.query("recserve_scoring_lookup_mode == 1")}  # fmt: skip
        assert modes == {
            (c, str(i), "remote") for c in ("torchserve", "serve") for i in range(len(stack.state.ps))
        }, modes

        import yaml

        rules = [r for g in yaml.safe_load(alerts.read_text())["groups"] for r in g["rules"]]
        assert {r["alert"] for r in rules} >= {
            "RecservePSShardDown",
            "RecserveVersionSkew",
            "RecserveScoringP99High",
            "RecserveDeltaLagHigh",
            "RecserveInputGuardTripped",
            "RecserveOutputGuardTripped",
        }
        for rule in rules:
            signal = re.fullmatch(r"(.+?)\s*(==|!=|>=|<=|>|<)\s*[0-9.]+", rule["expr"])
            assert signal, f"{rule['alert']}: not `<signal> <comparison> <threshold>`: {rule['expr']}"
            prom.query(rule["expr"])  # evaluates (an error fails here)
            assert prom.query(signal.group(1)), f"{rule['alert']}: its signal {signal.group(1)} has no series"
        # a scrape slower than its 1 s timeout marks a shard down for one evaluation (pending,
        # never firing: the rule waits 1m): a healthy stack's series clears by the next one
        wait_until(lambda: not prom.query('ALERTS{alertname="RecservePSShardDown"}'), 30,
                   "no shard of a healthy stack marked down")  # fmt: skip

        def healthy():
            body = json.loads(urllib.request.urlopen(f"{prom.url}/api/v1/rules", timeout=10).read())
            found = [r for g in body["data"]["groups"] for r in g["rules"]]
            return len(found) == len(rules) and all(r["health"] == "ok" for r in found) and found

        wait_until(healthy, 30, "every alert rule loaded and evaluated without error")
    finally:
        stop_children([serve, trainer, joiner, follower, watcher])


def _ping(port: int) -> bool:
    import urllib.request

    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2).status == 200
    except OSError:
        return False
