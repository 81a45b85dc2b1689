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
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import yaml

import model_store as ms
from model_store.deltas import DeltaManifest, read_delta
from serving.rpc.health import check
from serving.scoring.client import ScoringClient, requests_from_file
from tests.deploy.helpers import KUBE, build_overlay
from tests.helpers import ROOT, doc_blocks, exit_ok, second_half, train_version, wait_until
from tests.serving.helpers import TEST

pytestmark = pytest.mark.slow
IMAGE_WORKDIR = "/app"  # the image's WORKDIR: this checkout stands for it
IMAGE_VENV = "/opt/recserve"  # the image's venv: the venv running the tests stands for it
VENV = Path(sys.prefix)  # this checkout's .venv under `make test`; a shared one in a git worktree
STREAM_ROLES = ("join", "follow")
"""Workloads that need a Kafka cluster: ``test_the_stream_roles_...`` starts them with the test broker."""


def stream_role(pod: dict) -> bool:
    return pod["name"].rsplit("-", 1)[0] in STREAM_ROLES


def pods(objs: list[dict]) -> list[dict]:
    """One entry per pod the workloads make: name, the DNS names it answers to, its pod spec, its
    pod-index (StatefulSet ordinal, Job completion index) and whether a Job runs it."""
    services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    named: set[str] = set()  # a Service name goes to its first pod only: gRPC's resolver (c-ares)
    out = []  # merges /etc/hosts lines that share a name, and would send ps-1.ps to ps-0
    for w in (o for o in objs if o["kind"] in ("StatefulSet", "Deployment", "Job")):
        labels = w["spec"]["template"]["metadata"]["labels"]
        behind = [n for n, s in services.items() if s["spec"]["selector"].items() <= labels.items()]
        job = w["kind"] == "Job"
        if job:  # an Indexed Job: pod i's hostname is <job>-<i>, in its subdomain
            assert (
                w["spec"]["completionMode"] == "Indexed"
                and w["spec"]["parallelism"] == w["spec"]["completions"]
            )
        for i in range(w["spec"]["completions"] if job else w["spec"]["replicas"]):
            name = f"{w['metadata']['name']}-{i}"
            names = [name, *(n for n in behind if n not in named)]
            named.update(behind)
            if w["kind"] == "StatefulSet":
                names.append(f"{name}.{w['spec']['serviceName']}")
            if job:
                names.append(f"{name}.{w['spec']['template']['spec']['subdomain']}")
            claims = [t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])]
            out.append({"name": name, "names": names, "spec": w["spec"]["template"]["spec"], "index": i,
                        "job": job, "claims": claims})  # fmt: skip
    return out


def container_env(container: dict, pod: dict, config_maps: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e["valueFrom"]:
            path = e["valueFrom"]["fieldRef"]["fieldPath"]
            assert path == "metadata.labels['apps.kubernetes.io/pod-index']", path
            env[e["name"]] = str(pod["index"])
        else:
            ref = e["valueFrom"]["configMapKeyRef"]
            env[e["name"]] = config_maps[ref["name"]]["data"][ref["key"]]
    return env


def image_commands(directory: Path) -> Path:
    """The image's commands over this checkout's venv bound at IMAGE_VENV. The venv's own scripts
    name their interpreter by its path here, which a pod's /tmp volume hides when the checkout
    lies under /tmp (as a fresh clone may); these run the bound venv's python instead, which
    imports recserve from the WORKDIR (``PYTHONPATH``, set by ``Kubelet.run``: the image installs
    recserve in its venv, the editable install here names this checkout's path, and TorchServe
    starts its Python worker in the model's directory, where a checkout under /tmp is out of
    sight). ``python3`` is the venv's, as the image's PATH has it; ``java`` is this host's (the
    TorchServe image's is Debian's openjdk-17-jre-headless)."""
    directory.mkdir()
    for name, module in (("recserve", "-m recserve"), ("torchrun", "-m torch.distributed.run"),
                         ("torch-model-archiver", "-c 'import sys; from model_archiver.model_packaging import generate_model_archive as g; sys.exit(g())'"), ("python3", "")):  # fmt: skip
        (directory / name).write_text(f'#!/bin/sh\nexec {IMAGE_VENV}/bin/python {module} "$@"\n')
        (directory / name).chmod(0o755)
    return directory


def secret_files(directory: Path) -> Path:
    """The overlay's Secret as a directory of its secretGenerator's files, made by docs/kubernetes.md's
    lines (run by bash in ``directory``, as a user runs them at the checkout's root)."""
    (block,) = doc_blocks("docs/kubernetes.md", "The Secret's files")
    env = {**os.environ, "PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    for line in block:
        done = subprocess.run(["bash", "-c", line], cwd=directory, env=env, capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == 0, f"{line}\n{done.stderr}"
    overlay = directory / "deploy" / "kubernetes" / "overlays" / "small"
    kust = yaml.safe_load((KUBE / "overlays" / "small" / "kustomization.yaml").read_text())
    (generator,) = kust["secretGenerator"]
    secret = directory / "secret"
    secret.mkdir()
    for name in generator["files"]:  # kustomize keys a file by its base name
        (secret / Path(name).name).write_bytes((overlay / name).read_bytes())
    return secret


def probe(container: dict, address: str) -> tuple[bool, str]:
    """The container's readinessProbe as the kubelet calls it: HTTP GET (2xx/3xx passes) or gRPC
    health in plaintext (the kubelet's gRPC probe has no TLS); (passed, what it answered). HTTPS unverified, as the
    kubelet does it."""
    spec = container["readinessProbe"]
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    if "httpGet" in spec:
        get = spec["httpGet"]
        port, scheme = ports.get(get["port"], get["port"]), get.get("scheme", "HTTP").lower()
        unverified = ssl._create_unverified_context()  # the kubelet does not check a probe's certificate
        try:
            with urllib.request.urlopen(
                f"{scheme}://{address}:{port}{get['path']}", timeout=2, context=unverified
            ) as r:
                return 200 <= r.status < 400, f"{r.status} {r.read().decode().strip()}"
        except urllib.error.HTTPError as e:
            return False, f"{e.code} {e.read().decode().strip()}"
        except OSError as e:
            return False, str(e)
    assert set(spec) & {"grpc"}, f"a readiness probe this test does not call: {spec}"
    with grpc.insecure_channel(f"{address}:{spec['grpc']['port']}") as channel:
        status = check(channel, spec["grpc"].get("service", ""), timeout_s=2)
    return status == "SERVING", status


def expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: a defined variable is replaced, $$ escapes, others stay."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), arg)  # fmt: skip


class Kubelet:
    """Starts a pod's containers on a ``host`` as the kubelet would (init containers to completion
    first): its volumes as directories bound at their mount paths (the claim ``model-store`` is
    ``store``; a Secret or ConfigMap its keys as files, only ``items`` where listed; an emptyDir a
    directory of its own), the image's WORKDIR and venv being this checkout and its venv."""

    def __init__(self, tmp_path: Path, store: Path, secret: Path, config_maps: dict):
        self.tmp_path, self.store, self.secret, self.config_maps = tmp_path, store, secret, config_maps
        self.commands = image_commands(tmp_path / "image-bin")
        self.path = f"{IMAGE_VENV}-commands{os.pathsep}{os.environ['PATH']}"  # the image's commands on PATH

    def volume_dir(self, pod: dict, volume: dict) -> Path:
        if "persistentVolumeClaim" in volume:
            assert volume["persistentVolumeClaim"]["claimName"] == "model-store"
            return self.store
        d = self.tmp_path / pod["name"] / volume["name"]
        d.mkdir(parents=True, exist_ok=True)
        if "secret" in volume:
            items = volume["secret"].get("items") or [
                {"key": f.name, "path": f.name} for f in self.secret.iterdir()
            ]
            for item in items:
                (d / item["path"]).write_bytes((self.secret / item["key"]).read_bytes())
                (d / item["path"]).chmod(volume["secret"].get("defaultMode", 0o644))
        if "configMap" in volume:
            for key, text in self.config_maps[volume["configMap"]["name"]]["data"].items():
                (d / key).write_text(text)
        return d  # else an emptyDir

    def run(self, pod: dict, host, container: dict, wait: bool):
        volumes = {v["name"]: self.volume_dir(pod, v) for v in pod["spec"].get("volumes", [])}
        binds = {str(volumes[m["name"]]): m["mountPath"] for m in container.get("volumeMounts", [])}
        binds |= {
            str(ROOT): IMAGE_WORKDIR,
            str(VENV): IMAGE_VENV,
            str(self.commands): f"{IMAGE_VENV}-commands",
        }
        env = container_env(container, pod, self.config_maps)
        argv = [expand(a, env) for a in container["command"] + container.get("args", [])]
        proc_env = {**os.environ, "PATH": self.path, "PYTHONPATH": IMAGE_WORKDIR, **env}
        if wait:
            done = host.run(argv, binds, env=proc_env, cwd=IMAGE_WORKDIR, capture_output=True, text=True,
                            timeout=60)  # fmt: skip
            assert done.returncode == 0, f"{pod['name']} init {container['name']}: {done.stdout}{done.stderr}"
            return None
        log = self.tmp_path / f"{pod['name']}-{container['name']}.log"
        return host.popen(argv, log, env=proc_env, binds=binds, cwd=IMAGE_WORKDIR), log

    def start(self, pod: dict, host) -> tuple:
        """(host, process, log) of the pod's one container, its init containers run first."""
        for init in pod["spec"].get("initContainers", []):
            self.run(pod, host, init, wait=True)
        (container,) = pod["spec"]["containers"]
        return (host, *self.run(pod, host, container, wait=False))


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
    jobs = {pod["name"]: start(pod, host) for pod, host in placed if pod["job"]}
    exit_ok([(f"pod {name}", proc, log) for name, (_, proc, log) in jobs.items()])
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
        raise AssertionError(f"{e}; the probes answered {answers}") from None
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
    commands = image_commands(tmp_path / "image-bin")
    path = f"{IMAGE_VENV}-commands{os.pathsep}{os.environ['PATH']}"
    started = {}
    for pod in stream:
        volumes = {v["name"]: (store if "persistentVolumeClaim" in v else tmp_path / pod["name"] / v["name"])
                   for v in pod["spec"].get("volumes", [])}  # fmt: skip
        claims = pod.get("claims", [])
        volumes |= {name: tmp_path / pod["name"] / name for name in claims}
        for d in volumes.values():
            d.mkdir(parents=True, exist_ok=True)
        (container,) = pod["spec"]["containers"]
        binds = {str(volumes[m["name"]]): m["mountPath"] for m in container.get("volumeMounts", [])}
        binds |= {str(ROOT): IMAGE_WORKDIR, str(VENV): IMAGE_VENV, str(commands): f"{IMAGE_VENV}-commands"}
        cenv = container_env(container, pod, config_maps)
        argv = [expand(a, cenv) for a in container["command"] + container.get("args", [])]
        log = tmp_path / f"{pod['name']}.log"
        proc = host.popen(argv, log, env={**os.environ, "PATH": path, **cenv}, binds=binds, cwd=IMAGE_WORKDIR)
        started[pod["name"]] = (container, proc, log)

    def ready(name: str) -> bool:
        container, proc, log = started[name]
        if proc.poll() is not None:
            raise AssertionError(f"pod {name} exited {proc.returncode}: {log.read_text()[-3000:]}")
        return probe(container, host.address)[0]

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
    (state,) = (tmp_path / "follow-0" / "state").iterdir()  # the ledger on the pod's own volume
    assert state.name == "follow.json"


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
    _, proc, log = Kubelet(tmp_path, store, secret, config_maps).start(pod, host)
    (container,) = pod["spec"]["containers"]
    answer: list[str] = []

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"pod {pod['name']} exited {proc.returncode}: {log.read_text()[-3000:]}")
        passed, said = probe(container, host.address)
        answer[:] = [said]
        return passed

    try:
        wait_until(
            ready, 240, "the TorchServe pod's readiness probe to pass (JVM, then the handler's worker)"
        )
    except AssertionError as e:
        raise AssertionError(f"{e}; /ping answered {answer}; its log:\n{log.read_text()[-3000:]}") from None
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
