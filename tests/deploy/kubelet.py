"""The kubelet's part of tests/deploy/test_kubernetes_roles.py: the pods an overlay's workloads make,
each container started as the kubelet starts it (init containers first, $(VAR) and ConfigMap keys
resolved, volumes bound at their mount paths, this checkout standing for the image) on a network
namespace host, and its readiness probe called as the kubelet calls it."""

from __future__ import annotations

import os
import re
import shlex
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import grpc
import yaml

from serving.rpc.health import check
from tests.deploy.helpers import KUBE, image_env, instructions
from tests.helpers import ROOT, doc_blocks

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


def probe(container: dict, address: str, run: Callable[[list[str], float], tuple[int, str]] | None = None
          ) -> tuple[bool, str]:  # fmt: skip
    """The container's readinessProbe as the kubelet calls it: HTTP GET (2xx/3xx passes), gRPC
    health in plaintext (the kubelet's gRPC probe has no TLS) or a command in the container (exit 0
    passes; ``run(argv, timeout_s)`` runs it there, giving its exit status and output); (passed,
    what it answered). HTTPS unverified, as the kubelet does it."""
    spec = container["readinessProbe"]
    if "exec" in spec:
        assert run is not None, f"an exec probe needs its container: {spec}"
        code, said = run(spec["exec"]["command"], spec.get("timeoutSeconds", 1))
        return code == 0, said.strip()
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
    directory of its own; a StatefulSet's volume claim template too), the image's WORKDIR and venv
    being this checkout and its venv. ``secret``: the Secret's files (None: no pod mounts it)."""

    def __init__(self, tmp_path: Path, store: Path, secret: Path | None, config_maps: dict):
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
            assert self.secret is not None, f"pod {pod['name']} mounts the Secret: give the Kubelet its files"
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

    def context(self, pod: dict, container: dict) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
        """(binds, the container's own env, the processes' env) of a container of ``pod``."""
        volumes = {v["name"]: self.volume_dir(pod, v) for v in pod["spec"].get("volumes", [])}
        volumes |= {name: self.volume_dir(pod, {"name": name}) for name in pod.get("claims", [])}
        binds = {str(volumes[m["name"]]): m["mountPath"] for m in container.get("volumeMounts", [])}
        env = container_env(container, pod, self.config_maps)
        return binds | self.image_binds(), env, {**self.process_env(), **env}

    def image_binds(self) -> dict[str, str]:
        """The image's files: its WORKDIR, venv and commands (this checkout, its venv, ``image_commands``)."""
        return {str(ROOT): IMAGE_WORKDIR, str(VENV): IMAGE_VENV, str(self.commands): f"{IMAGE_VENV}-commands"}

    def process_env(self) -> dict[str, str]:
        """A process's environment before its container's own: the image's ENV (numba's cache in the
        image's venv, HOME), its PATH being the image's commands here and recserve the WORKDIR's."""
        return {**os.environ, **image_env(), "PATH": self.path, "PYTHONPATH": IMAGE_WORKDIR}

    def warm(self, host) -> tuple:
        """The image build's ``recserve warm`` (deploy/image/Containerfile), started on ``host`` in the
        image's WORKDIR and ENV: numba's cache in the image's venv (here this venv's ``numba-cache``),
        which the frontend's init container copies, so that it starts warm as it does from the image.
        (process, log) to wait for."""
        (argv,) = [shlex.split(step) for run in instructions()["RUN"] for step in run.split("&&")
                   if step.split()[:2] == ["recserve", "warm"]]  # fmt: skip
        log = self.tmp_path / "image-warm.log"
        return host.popen(argv, log, env=self.process_env(), binds=self.image_binds(),
                          cwd=IMAGE_WORKDIR), log  # fmt: skip

    def exec(self, pod: dict, host, container: dict) -> Callable[[list[str], float], tuple[int, str]]:
        """An exec probe's runner for ``container`` on ``host``: the command as given (the kubelet
        expands no $(VAR) there), in the container's mounts, env and WORKDIR; a timeout fails it."""
        binds, _, proc_env = self.context(pod, container)

        def run(argv: list[str], timeout_s: float) -> tuple[int, str]:
            try:
                done = host.run(argv, binds, env=proc_env, cwd=IMAGE_WORKDIR, capture_output=True, text=True,
                                timeout=timeout_s)  # fmt: skip
            except subprocess.TimeoutExpired:
                return -1, f"timed out after {timeout_s} s"
            return done.returncode, done.stdout + done.stderr

        return run

    def run(self, pod: dict, host, container: dict, wait: bool):
        binds, env, proc_env = self.context(pod, container)
        argv = [expand(a, env) for a in container["command"] + container.get("args", [])]
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
