"""The manifests' commands run: the Secret's files are made by docs/kubernetes.md's lines, then every pod
of the small overlay starts in its own network namespace with exactly its containers' commands, args
and environment (init containers first; $(VAR), the pod-index label and ConfigMap keys resolved as
the kubelet does; each volume bound at its mountPath; the image's WORKDIR /app this checkout;
Service and pod names through /etc/netns/<ns>/hosts). Every readiness probe must pass as the kubelet
calls it, and a request scored through the frontend equals the trainer's own scores. A flag renamed
in the code and not in the manifests fails here (its role exits; the wait names its log), and so
does a certificate missing a name a client dials."""

from __future__ import annotations

import json
import os
import re
import shutil
import ssl
import sys
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

import model_store as ms
from model_store.deltas import DeltaManifest, read_delta
from serving.rpc.health import check
from serving.scoring.client import ScoringClient, requests_from_file
from tests.deploy.helpers import KUBE, build_overlay
from tests.deploy.kubelet import (
    VENV,
    Kubelet,
    pods,
    probe,
    secret_files,
    stream_role,
)
from tests.helpers import ROOT, exit_ok, second_half, train_version, wait_until
from tests.serving.helpers import TEST

pytestmark = pytest.mark.slow


def test_every_pod_of_the_small_overlay_runs_as_its_manifest_says_and_scores(network, tmp_path):
    """The training Job's pods first, to completion (two torchrun nodes, the job's own PS shards):
    the version they publish is the one the serving pods then follow and score with."""
    objs = build_overlay(KUBE / "overlays" / "small")
    config_maps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    secret = secret_files(tmp_path)  # the overlay's secretGenerator files, made as docs/kubernetes.md says
    all_pods = [p for p in pods(objs) if not stream_role(p)]
    assert {p["name"] for p in all_pods} >= {"train-0", "train-1", "ps-0", "ps-1", "worker-0", "scoring-0"}
    net = network(len(all_pods), [" ".join(p["names"]) for p in all_pods])
    store = tmp_path / "store"
    store.mkdir()
    kubelet = Kubelet(tmp_path, store, secret, config_maps)
    start = kubelet.start

    placed = list(zip(all_pods, net.hosts, strict=True))
    warming = kubelet.warm(net.hosts[-1])  # the image's build step, beside the training Job
    jobs = {pod["name"]: start(pod, host) for pod, host in placed if pod["job"]}
    exit_ok([(f"pod {name}", proc, log) for name, (_, proc, log) in jobs.items()])
    exit_ok([("the image's recserve warm", *warming)])
    assert ms.current(store, "criteo") == "1", "the training Job published no version"
    assert ms.read_manifest(ms.version_dir(store, "criteo", "1")).train.world_size == 2  # type: ignore[union-attr]
    started = {pod["name"]: start(pod, host) for pod, host in placed if not pod["job"]}

    containers = {pod["name"]: pod["spec"]["containers"][0] for pod in all_pods}
    answers: dict[str, str] = {}

    def all_ready() -> bool:
        for name, (host, proc, log) in started.items():
            if proc.poll() is not None:
                raise AssertionError(f"pod {name} exited {proc.returncode}: {log.read_text()[-3000:]}")
            passed, answers[name] = probe(containers[name], host.address)
            if not passed:
                return False
        return True

    try:
        wait_until(all_ready, 120, "every serving pod's readiness probe to pass across the namespaces")
    except AssertionError as e:
        logs = {name: log.read_text()[-2000:] for name, (_, _, log) in started.items()
                if not answers.get(name, "").startswith("200")}  # fmt: skip
        raise AssertionError(f"{e}; the probes answered {answers}; the others' logs end {logs}") from None
    cache = {p.relative_to(VENV / "numba-cache") for p in (VENV / "numba-cache").rglob("*.nbc")}
    for pod in (
        p for p in all_pods if p["name"].startswith("scoring-")
    ):  # numba's cache: the image's, copied
        name, copied = pod["name"], kubelet.volume_dir(pod, {"name": "tmp"}) / "numba-cache"
        assert cache and {p.relative_to(copied) for p in copied.rglob("*.nbc")} == cache, f"{name} compiled"
    with grpc.insecure_channel(f"{started['ps-0'][0].address}:50061") as channel:
        assert check(channel, timeout_s=2) == "UNAVAILABLE"  # mTLS: a plaintext client gets nothing
    frontends = [(n, s) for n, s in started.items() if n.startswith("scoring-")]
    host = frontends[0][1][0]
    url = "https://scoring:8080/predictions/criteo"  # the Service's name, which the certificate names
    with pytest.raises(ssl.SSLCertVerificationError):  # HTTPS: a client that does not trust the CA
        ScoringClient(url.replace("scoring", host.address)).post(b"[{}]")
    done = host.run(  # from a pod's namespace, where `scoring` resolves as in the cluster
        [sys.executable, "-m", "tests.deploy.score", url, str(secret / "key_file.json"), str(secret / "ca.pem")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    replies = out["replies"]
    assert all(status == 200 for status, _ in replies), replies
    scores = [x for _, reply in replies for x in reply["scores"]]
    versions = {(reply["versions"]["dense"], reply["versions"]["embedding"]) for _, reply in replies}
    current = ms.current(store, "criteo")
    offline = np.load(ms.version_dir(store, "criteo", current) / "eval" / "scores.npy")[: len(scores)]
    assert len(scores) == 400 and np.abs(np.array(scores) - offline).max() <= 1e-6
    assert versions == {(current, current)}
    assert (out["bad_json"], out["no_token"]) == (400, 401)


def test_the_stream_roles_run_as_their_manifests_say_against_the_test_broker(network, trained, tmp_path):
    """The joiner and the streaming trainer, started with exactly their containers' commands, args,
    environment and volumes, the ConfigMap's bootstrap being the test broker's: simulated users'
    impressions and clicks are joined into samples, which the trainer trains into a delta of the
    served version. librdkafka's mock cluster listens on loopback only, so the two pods and the
    broker share one network namespace (each pod has its own mount and UTS namespace)."""
    objs = build_overlay(KUBE / "overlays" / "small")
    config_maps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    stream = [p for p in pods(objs) if stream_role(p)]
    assert sorted(p["name"] for p in stream) == ["follow-0", "join-0"]
    (host,) = network(1, [" ".join(n for p in stream for n in p["names"])]).hosts
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    topics = ("impressions:2", "events:2", "samples:2", "impressions.dead:1", "events.dead:1", "samples.dead:1",
              "samples.quarantine:2")  # fmt: skip
    broker_log = tmp_path / "kafka.log"
    host.popen([sys.executable, "-m", "loadtest.mockbroker", *(a for t in topics for a in ("--topic", t))],
               broker_log, env=env, cwd=ROOT)  # fmt: skip
    found = wait_until(lambda: re.search(r"BOOTSTRAP=(\S+)", broker_log.read_text()), 60, "the test broker")
    config_maps["recserve-kafka"]["data"]["bootstrap"] = found[1]
    store = tmp_path / "store"
    shutil.copytree(trained[0], store)
    kubelet = Kubelet(tmp_path, store, None, config_maps)
    started = {pod["name"]: (pod, *kubelet.start(pod, host)[1:]) for pod in stream}

    def ready(name: str) -> bool:
        pod, proc, log = started[name]
        if proc.poll() is not None:
            raise AssertionError(f"pod {name} exited {proc.returncode}: {log.read_text()[-3000:]}")
        (container,) = pod["spec"]["containers"]
        return probe(container, host.address, kubelet.exec(pod, host, container))[0]

    wait_until(lambda: all(ready(name) for name in started), 120, "the stream pods' readiness probes to pass")
    host.popen([sys.executable, "-m", "loadtest.stream_users", "--brokers", found[1], "--requests", "10",
                "--delay-s", "0.2"], tmp_path / "users.log", env=env, cwd=ROOT)  # fmt: skip
    vdir = ms.version_dir(store, "criteo", ms.current(store, "criteo"))

    def trained_samples() -> int:
        ready("follow-0")  # still running
        return sum(
            (read_delta(ms.delta_dir(vdir, seq)) or DeltaManifest("")).samples for seq in ms.list_deltas(vdir)
        )

    wait_until(trained_samples, 120, "clicks joined into samples and trained into a delta")
    state = tmp_path / "follow-0" / "state"  # the ledger on the pod's own volume, committed at the
    # trainer's next look once the delta is published (its files are written on their own thread)
    assert wait_until(lambda: [f.name for f in state.iterdir()], 60, "the ledger's commit") == ["follow.json"]


def test_the_torchserve_component_runs_as_its_manifest_says_and_scores(network, trained, tmp_path):
    """components/torchserve's pod (overlays/torchserve): its init container archives the handler
    for the store's CURRENT version, then TorchServe's Java frontend (this host's Java 17) runs it
    with co-located lookups -- no PS or worker pod is started, the handler maps the version's shards
    from the store. Its readiness probe passes as the kubelet calls it, and 400 rows scored through
    `http://torchserve:8080` from its namespace equal the trainer's; then a version trained and
    published into the store is served by the same pod (its worker follows the model), 400 rows
    equal to that version's own scores."""
    objs = build_overlay(KUBE / "overlays" / "torchserve")
    config_maps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ConfigMap"}
    (pod,) = [p for p in pods(objs) if p["name"].startswith("torchserve-")]
    (host,) = network(1, [" ".join(pod["names"])]).hosts
    store = tmp_path / "store"
    shutil.copytree(trained[0], store)
    secret = secret_files(tmp_path)
    kubelet = Kubelet(tmp_path, store, secret, config_maps)
    _, proc, log = kubelet.start(pod, host)
    (container,) = pod["spec"]["containers"]
    answer: list[str] = []

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"pod {pod['name']} exited {proc.returncode}: {log.read_text()[-3000:]}")
        passed, said = probe(container, host.address, kubelet.exec(pod, host, container))
        answer[:] = [said]
        return passed

    try:
        wait_until(
            ready, 240, "the TorchServe pod's readiness probe to pass (JVM, then the handler's worker)"
        )
    except AssertionError as e:
        raise AssertionError(
            f"{e}; the probe answered {answer}; its log:\n{log.read_text()[-3000:]}"
        ) from None
    url = "http://torchserve:8080/predictions/criteo"  # the Service's name (plain HTTP: see the component)

    def scores_like_offline(current: str) -> None:
        done = host.run(
            [sys.executable, "-m", "tests.deploy.score", url, str(secret / "key_file.json"), ""],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        out = json.loads(done.stdout)
        replies = out["replies"]
        assert all(status == 200 for status, _ in replies), replies
        scores = [x for _, reply in replies for x in reply["scores"]]
        offline = np.load(ms.version_dir(store, "criteo", current) / "eval" / "scores.npy")[: len(scores)]
        assert len(scores) == 400 and np.abs(np.array(scores) - offline).max() <= 1e-6
        assert {(r["versions"]["dense"], r["versions"]["embedding"]) for _, r in replies} == {
            (current, current)
        }
        assert out["bad_json"] == 400  # (its token auth is off: the component's header says why)

    scores_like_offline(ms.current(store, "criteo"))
    # a newly published version is served by the same pod, no restart (its worker follows the model)
    train_version(store, seed=1, publish=False, data=second_half(tmp_path))  # version 2: other rows
    ms.publish(store, "criteo", "2", allow_schema_change=True)
    (body, ctype), *_ = requests_from_file(TEST, "data/schemas/criteo.yaml", 20, 20)

    def dense_version() -> str:
        assert proc.poll() is None, f"pod {pod['name']} exited {proc.returncode}: {log.read_text()[-3000:]}"
        request = urllib.request.Request(f"http://{host.address}:8080/predictions/criteo", body,
                                         {"Content-Type": ctype})  # fmt: skip
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read())["versions"]["dense"]

    wait_until(lambda: dense_version() == "2", 120, "the TorchServe pod to serve version 2 once published")
    scores_like_offline("2")
