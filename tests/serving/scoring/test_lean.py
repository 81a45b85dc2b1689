"""``recserve serve --workers 1`` (serving/scoring/lean.py) as one real process: it follows the store itself
(503 naming why before anything is published, then the published version), answers the scoring
core's statuses, requires its token, exposes the lookup mode on /metrics, switches to a retrained
version with no response mixing versions, and drains on SIGTERM."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import orjson
import pytest

import model_store as ms
from serving.scoring.client import ScoringClient, requests_from_file
from tests.helpers import free_port, second_half, train_version, wait_until
from tests.serving.helpers import TEST

pytestmark = pytest.mark.slow
SCHEMA = "data/schemas/criteo.yaml"


def _get(port: int, path: str, headers: dict | None = None, method: str = "GET", body: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body, headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    except ConnectionError:
        return None, b""
    finally:
        conn.close()


@pytest.fixture(scope="module")
def lean(tmp_path_factory):
    """A store with version 1 trained but not published, and `recserve serve` over it, polling every
    600 s: it learns of each new CURRENT by its notice (inotify, the default)."""
    root = tmp_path_factory.mktemp("store")
    train_version(root, seed=0, publish=False)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "recserve", "serve", "--workers", "1", "--store", str(root), "--port", str(port), "--poll-s", "600",
         "--drain-s", "0.5"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout), daemon=True).start()
    wait_until(lambda: _get(port, "/ping")[0] is not None or proc.poll() is not None, 60, "listening")
    assert proc.poll() is None, "".join(log)
    key_file = root / ".run" / "criteo" / "serve-key_file.json"
    yield root, port, proc, key_file, log
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


def test_nothing_published_is_a_503_naming_why_then_the_published_version_serves(lean):
    root, port, _, key_file, _ = lean
    status, body = _get(port, "/ping")
    assert status == 503 and "no version published yet for model criteo" in orjson.loads(body)["error"]
    key = json.loads(key_file.read_text())["inference"]["key"]
    status, body = _get(port, "/predictions/criteo", {"Authorization": f"Bearer {key}"}, "POST", b"[{}]")
    assert status == 503 and "no version published yet" in orjson.loads(body)["error"]
    ms.publish(root, "criteo", "1")
    wait_until(lambda: _get(port, "/ping")[0] == 200, 60, "serving after publish")
    assert orjson.loads(_get(port, "/ping")[1]) == {
        "status": "Healthy",
        "version": "1",
        "lookups": ["colocated", "colocated"],
    }


def test_scores_like_offline_with_the_core_statuses_and_its_token(lean):
    root, port, _, key_file, log = lean
    wait_until(lambda: _get(port, "/ping")[0] == 200, 60, "serving")
    assert os.stat(key_file).st_mode & 0o077 == 0  # the key is the user's alone
    client = ScoringClient(f"http://127.0.0.1:{port}/predictions/criteo", key_file=str(key_file))
    scores = []
    for body, ctype in requests_from_file(TEST, SCHEMA, 200, 400):
        status, payload = client.post(body, ctype)
        assert status == 200, payload
        scores.extend(orjson.loads(payload)["scores"])
    columns = []  # the same requests in column form
    for body, ctype in requests_from_file(TEST, SCHEMA, 200, 400, columns=True):
        status, payload = client.post(body, ctype)
        assert status == 200, payload
        columns.extend(orjson.loads(payload)["scores"])
    offline = np.load(ms.version_dir(root, "criteo", "1") / "eval" / "scores.npy")[: len(scores)]
    assert np.abs(np.array(scores) - offline).max() <= 1e-6
    assert np.abs(np.array(columns) - offline).max() <= 1e-6
    key = {"Authorization": "Bearer " + json.loads(key_file.read_text())["inference"]["key"]}
    js = {**key, "Content-Type": "application/json"}
    cases = [
        ({}, "POST", "/predictions/criteo", b"[{}]", 401, "token authorization failed"),
        ({"Authorization": "Bearer wrong"}, "POST", "/predictions/criteo", b"[{}]", 401, "token"),
        (js, "POST", "/predictions/criteo", b"{not json", 400, "malformed JSON"),
        (js, "POST", "/predictions/criteo", orjson.dumps([{}] * 1001), 413, "exceed the limit of 1000"),
        (
            js,
            "POST",
            "/predictions/criteo",
            orjson.dumps({"items": {"C1": ["a"] * 1001}}),
            413,
            "exceed the limit",
        ),
        (
            js,
            "POST",
            "/predictions/criteo",
            orjson.dumps({"items": {"C1": ["a"], "C2": []}}),
            400,
            "same non-zero",
        ),
        (js, "POST", "/predictions/criteo", b'{"items": {"C1": ["a"], "I1": ["x"]}}', 400, "'I1'"),
        (
            {**key, "Content-Type": "text/plain"},
            "POST",
            "/predictions/criteo",
            b"[{}]",
            415,
            "unsupported content",
        ),
        (js, "POST", "/predictions/avazu", b"[{}]", 404, "model 'avazu' is not served here"),
        (js, "GET", "/predictions/criteo", None, 405, "use POST"),
        (js, "POST", "/predictions/criteo", b"", 400, "empty request body"),
    ]
    for headers, method, path, body, want, words in cases:
        status, payload = _get(port, path, headers, method, body)
        assert (status, words in orjson.loads(payload)["error"]) == (want, True), (
            path,
            body and body[:20],
            payload,
        )
    metrics = _get(port, "/metrics")[1].decode()
    assert 'recserve_scoring_lookup_mode{mode="colocated",shard="0"} 1.0' in metrics
    assert 'recserve_scoring_lookup_mode{mode="remote",shard="1"} 0.0' in metrics
    runtime = ms.read_manifest(ms.version_dir(root, "criteo", "1")).dense_runtime.default  # type: ignore[union-attr]
    other = next(r for r in ("torchscript", "onnx") if r != runtime)
    assert (
        f'recserve_scoring_dense_runtime{{runtime="{runtime}"}} 1.0' in metrics
    )  # auto: the export's choice
    assert f'recserve_scoring_dense_runtime{{runtime="{other}"}} 0.0' in metrics
    assert 'recserve_scoring_dense_device{device="cpu"} 1.0' in metrics  # --device cpu, the default
    assert 'recserve_scoring_dense_device{device="cuda"} 0.0' in metrics
    assert (
        'recserve_scoring_requests_total{dense_version="1",embedding_version="1",model="criteo",status="200"} 4.0'
        in metrics
    )
    assert (
        'status="413"} 2.0' in metrics
        and 'recserve_scoring_version{model="criteo",version="1"} 1.0' in metrics
    )
    # a column form the compiled scan leaves to orjson (an escape) scores, and the log says so once
    assert not any("parsed by orjson" in line for line in log)
    status, _ = _get(port, "/predictions/criteo", js, "POST", b'{"items": {"C1": ["\\u0061"], "I1": [1]}}')
    assert status == 200
    wait_until(
        lambda: any("parsed by orjson" in line for line in log), 10, "the note that the scan was missed"
    )


def test_a_retrained_version_switches_in_with_no_response_mixing_versions(lean, tmp_path):
    root, port, _, key_file, _ = lean
    wait_until(lambda: _get(port, "/ping")[0] == 200, 60, "serving")
    train_version(
        root, seed=1, publish=False, data=second_half(tmp_path)
    )  # version 2: other rows, other statistics
    bodies = list(requests_from_file(TEST, SCHEMA, 200, 400))
    replies, stop = [], threading.Event()

    def loop() -> None:  # scores while the version switches under it
        client = ScoringClient(f"http://127.0.0.1:{port}/predictions/criteo", key_file=str(key_file))
        while not stop.is_set():
            for body, ctype in bodies:
                replies.append(client.post(body, ctype))
        client.close()

    scorer = threading.Thread(target=loop)
    scorer.start()
    try:
        ms.publish(root, "criteo", "2", allow_schema_change=True)
        wait_until(
            lambda: orjson.loads(_get(port, "/ping")[1]).get("version") == "2", 90, "serving version 2"
        )
        wait_until(lambda: sum(orjson.loads(p)["versions"]["dense"] == "2" for s, p in replies if s == 200) >= 4,
                   30, "replies of version 2")  # fmt: skip
    finally:
        stop.set()
        scorer.join(30)
    assert {s for s, _ in replies} == {200}
    seen = set()
    for _, payload in replies:
        v = orjson.loads(payload)["versions"]
        assert v["embedding"] == v["dense"] and {name for name, _ in v["shards"]} == {v["dense"]}, v
        seen.add(v["dense"])
    assert seen == {"1", "2"}
    client = ScoringClient(f"http://127.0.0.1:{port}/predictions/criteo", key_file=str(key_file))
    scores = [s for body, ctype in bodies for s in orjson.loads(client.post(body, ctype)[1])["scores"]]
    offline = np.load(ms.version_dir(root, "criteo", "2") / "eval" / "scores.npy")[: len(scores)]
    assert np.abs(np.array(scores) - offline).max() <= 1e-6


def test_sigterm_drains_and_exits_0(lean):
    _, _, proc, _, log = lean
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, "".join(log)


def test_a_version_loads_at_the_priority_requests_are_scored_at(trained, monkeypatch):
    """The loader shares the GIL with the requests: at nice 10, preempted while holding it, it kept
    them waiting (serving/scoring/follow.py ``ScorerFollower.follow``)."""
    from serving.scoring import follow as follow_module
    from serving.scoring import lean as lean_module

    seen: list[int] = []

    class Recording(follow_module.Scorer):
        def __init__(self, *a, **kw):
            seen.append(os.getpriority(os.PRIO_PROCESS, 0))  # this thread's niceness (Linux)
            super().__init__(*a, **kw)

    monkeypatch.setattr(follow_module, "Scorer", Recording)
    frontend = lean_module.Frontend(lean_module.ServeConfig(store=str(trained[0]), disable_token_auth=True))
    try:
        loaded: list = []
        loader = threading.Thread(target=lambda: loaded.append(frontend.step()))  # as follow's loader
        loader.start()
        loader.join(120)
        assert loaded == [Path(trained[1].version_dir).name] and seen == [
            os.getpriority(os.PRIO_PROCESS, 0)
        ], (loaded, seen)
    finally:
        frontend.close()
