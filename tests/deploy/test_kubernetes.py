"""deploy/kubernetes: every manifest validates offline against the Kubernetes schemas
(kubernetes-validate), the overlay's patches apply to the base and the result validates too, and
nothing runs as root."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from tests.deploy.helpers import KUBE, VERSION, build_overlay, documents, workloads


def test_every_base_manifest_validates_against_the_kubernetes_schemas():
    objs = documents(KUBE / "base")
    kinds = {o["kind"] for o in objs}
    assert {"StatefulSet", "Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget",
            "PersistentVolumeClaim", "ConfigMap", "Job"} <= kinds  # fmt: skip
    for obj in objs:
        kubernetes_validate.validate(obj, VERSION, strict=True)


@pytest.mark.parametrize("overlay", ["small", "replicated"])
def test_the_overlays_apply_and_validate(overlay):
    objs = build_overlay(KUBE / "overlays" / overlay)
    for obj in objs:
        kubernetes_validate.validate(obj, VERSION, strict=True)
    replicas = {o["metadata"]["name"]: o["spec"].get("replicas") for o in workloads(objs)}
    assert replicas["worker"] == 1 and replicas["ps"] == 2
    topology = next(o for o in objs if o["kind"] == "ConfigMap")
    if overlay == "small":  # one replica of every shard
        assert "ps-r1" not in replicas and "|" not in topology["data"]["ps"]
    else:  # components/ps-replica: the one PS template again, as ps-r1, in the workers' topology
        assert replicas["ps-r1"] == 2 and topology["data"]["ps"].count("|") == 2
        ps, r1 = (next(o for o in workloads(objs) if o["metadata"]["name"] == n) for n in ("ps", "ps-r1"))
        assert r1["spec"]["template"]["spec"] == ps["spec"]["template"]["spec"]
        assert r1["spec"]["template"]["metadata"]["labels"]["recserve/replica"] == "1"


def test_a_component_and_replacements_build_as_kustomize_builds_them(tmp_path):
    """tests/deploy/helpers.build against kustomize itself, where kubectl is installed: the same
    objects for base/ and every overlay (the Secret aside: its files are made by the roles test)."""
    import shutil
    import subprocess

    import yaml

    from tests.deploy.helpers import build

    if shutil.which("kubectl") is None:
        pytest.skip("no kubectl: helpers.build is checked against kustomize where it is installed")
    shutil.copytree(KUBE, tmp_path / "kubernetes")
    small = tmp_path / "kubernetes" / "overlays" / "small"
    for name in (
        "key_file.json",
        "tls/ca.pem",
        "tls/server.pem",
        "tls/server.key",
        "tls/client.pem",
        "tls/client.key",
    ):
        (small / name).parent.mkdir(exist_ok=True)
        (small / name).write_text("{}")
    for directory in ("base", "overlays/small", "overlays/replicated", "overlays/torchserve"):
        out = subprocess.run(["kubectl", "kustomize", str(tmp_path / "kubernetes" / directory)],
                             capture_output=True, text=True, timeout=60, check=True).stdout  # fmt: skip
        real = [o for o in yaml.safe_load_all(out) if o and o["kind"] != "Secret"]
        key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
        assert sorted(real, key=key) == sorted(build(KUBE / directory), key=key), directory


def test_a_manifest_error_is_caught():
    """The validation can fail: a misspelt field in a copy of the PS StatefulSet is refused."""
    sts = copy.deepcopy(next(o for o in documents(KUBE / "base") if o["kind"] == "StatefulSet"))
    sts["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy "] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, VERSION, strict=True)


@pytest.mark.parametrize("directory", ["base", "overlays/torchserve"])
def test_no_container_runs_as_root_or_unbounded(directory):
    for obj in workloads(documents(KUBE / directory)):
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, obj["metadata"]["name"]
        assert pod["securityContext"]["runAsUser"] != 0
        for c in pod.get("initContainers", []) + pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], c["name"]
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], c["name"]


def test_the_torchserve_component_runs_the_handler_with_colocated_lookups():
    """components/torchserve adds exactly its ConfigMap, Deployment and Service to the small
    overlay, all valid; its pod runs TorchServe's frontend from recserve-torchserve:latest, its
    init container archives the handler the image holds following the model with co-located
    lookups (no version pinned: a new one is served without a restart), and TorchServe
    reads the config it mounts; its management API listens on loopback only."""
    from tests.helpers import ROOT

    objs = build_overlay(KUBE / "overlays" / "torchserve")
    for obj in objs:
        kubernetes_validate.validate(obj, VERSION, strict=True)
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    small = build_overlay(KUBE / "overlays" / "small")
    assert sorted(map(key, objs)) == sorted(
        [
            *map(key, small),
            ("ConfigMap", "torchserve-config"),
            ("Deployment", "torchserve"),
            ("Service", "torchserve"),
        ]
    )
    assert [
        o for o in objs if key(o) in set(map(key, small))
    ] == small  # nothing of the small overlay changes
    deployment = next(o for o in objs if key(o) == ("Deployment", "torchserve"))
    pod = deployment["spec"]["template"]["spec"]
    (archive,), (container,) = pod["initContainers"], pod["containers"]
    assert {archive["image"], container["image"]} == {"recserve-torchserve:latest"}
    script = archive["args"][0]
    scoring_json = (
        '{"store": "/store", "model": "%s", "lookups": "colocated"}'  # follows the model: no version
    )
    assert scoring_json in script and "CURRENT" not in script and "--version 1.0 " in script
    handler = "/app/handlers/recserve_handler.py"  # the image's WORKDIR /app: this checkout's handlers/
    assert f"--handler {handler}" in script and (ROOT / handler.removeprefix("/app/")).is_file()
    assert (
        f"COPY handlers/recserve_handler.py {handler}"
        in (ROOT / "deploy/image/Containerfile.torchserve").read_text()
    )
    args = container["args"]
    assert container["command"] == ["java"] and "org.pytorch.serve.ModelServer" in args
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    config = args[args.index("-f") + 1]
    (cm,) = [v["configMap"]["name"] for v in pod["volumes"] if v["name"] == "config"]
    props = dict(
        line.split("=", 1)
        for line in next(o for o in objs if key(o) == ("ConfigMap", cm))["data"][
            "config.properties"
        ].splitlines()
    )
    assert (
        config == f"{mounts['config']}/config.properties" and args[args.index("-s") + 1] == mounts["models"]
    )
    assert props["inference_address"] == "http://0.0.0.0:8080" and props["management_address"].startswith(
        "http://127."
    )
    assert not [v for v in pod["volumes"] if "secret" in v]  # plain HTTP: the component's header says why


def shard_count(container: dict, topology: dict) -> str:
    """The --num-shards a container runs with: ``$(NUM_SHARDS)`` from recserve-topology's shards."""
    args = container["args"]
    assert args[args.index("--num-shards") + 1] == "$(NUM_SHARDS)", container["name"]
    (env,) = [e for e in container["env"] if e["name"] == "NUM_SHARDS"]
    assert env["valueFrom"]["configMapKeyRef"] == {"name": "recserve-topology", "key": "shards"}
    return topology["data"]["shards"]


@pytest.mark.parametrize("directory", ["base", "overlays/replicated"])
def test_the_worker_topology_names_every_ps_pod(directory):
    """The workers' --ps lists pod <statefulset>-<shard>.ps for every shard of every PS StatefulSet,
    shards in order; the shard count is written once (recserve-topology's shards): every PS
    StatefulSet has that many pods and runs with that --num-shards."""
    from serving.worker.replicas import parse_ps_spec

    objs = documents(KUBE / directory)
    stss = [o for o in objs if o["kind"] == "StatefulSet" and o["spec"]["serviceName"] == "ps"]
    topology = next(
        o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "recserve-topology"
    )
    shards = parse_ps_spec(topology["data"]["ps"])
    assert stss and all(len(replicas) == len(stss) for replicas in shards)
    for sts in stss:
        num_shards = int(shard_count(sts["spec"]["template"]["spec"]["containers"][0], topology))
        assert sts["spec"]["replicas"] == num_shards == len(shards)
        for i, replicas in enumerate(shards):
            assert f"{sts['metadata']['name']}-{i}.ps:50061" in replicas


def test_the_training_job_matches_its_nodes_and_the_serving_shards():
    """The Indexed Job runs one torchrun node per pod (--nnodes = completions = parallelism), its
    rendezvous is pod 0 in its subdomain, and it trains as many shards as the PS StatefulSets serve."""
    objs = documents(KUBE / "base")
    job = next(o for o in objs if o["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert pod["containers"][0]["command"] == ["torchrun"]
    assert job["spec"]["completionMode"] == "Indexed"
    assert int(args[args.index("--nnodes") + 1]) == job["spec"]["completions"] == job["spec"]["parallelism"]
    assert args[args.index("--rdzv-endpoint") + 1] == f"{job['metadata']['name']}-0.{pod['subdomain']}:29400"
    assert any(o["kind"] == "Service" and o["metadata"]["name"] == pod["subdomain"] for o in objs)
    topology = next(o for o in objs if o["kind"] == "ConfigMap")
    ps = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "ps")
    ps_container = ps["spec"]["template"]["spec"]["containers"][0]
    assert shard_count(pod["containers"][0], topology) == shard_count(ps_container, topology)
    assert "--resume" in args and "--checkpoint-every" in args and "--max-restarts" in args


def test_the_documented_certificate_names_every_address_a_client_dials_and_pods_get_their_files():
    """docs/kubernetes.md's `recserve certs` line names every PS pod of the replicated topology, every worker
    address a frontend dials and the Service of every HTTPS frontend; each file a container's --tls-*/--ps-tls-* flag names is one its
    init container copies from the Secret, and one the overlay's Secret holds."""
    import re
    import shlex

    import yaml

    from serving.worker.replicas import parse_ps_spec
    from tests.helpers import doc_blocks

    (line, _key_file) = doc_blocks("docs/kubernetes.md", "The Secret's files")[0]
    argv = shlex.split(line)
    names = set(argv[argv.index("--hosts") + 1].split(","))
    objs = documents(KUBE / "overlays" / "replicated")  # every PS pod: both replicas of each shard
    topology = next(
        o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "recserve-topology"
    )
    dialed = {a.rsplit(":", 1)[0] for replicas in parse_ps_spec(topology["data"]["ps"]) for a in replicas}
    kust = yaml.safe_load((KUBE / "overlays" / "small" / "kustomization.yaml").read_text())
    in_secret = {f.rsplit("/", 1)[-1] for f in kust["secretGenerator"][0]["files"]}
    for obj in workloads(objs):
        pod = obj["spec"]["template"]["spec"]
        args = pod["containers"][0].get("args", [])
        if "--worker" in args:
            dialed |= {a.rsplit(":", 1)[0] for a in args[args.index("--worker") + 1].split("|")}
        if "--https-cert" in args:  # its clients dial its Service
            dialed |= {s["metadata"]["name"] for s in objs if s["kind"] == "Service"
                       and s["spec"]["selector"].items() <= obj["spec"]["template"]["metadata"]["labels"].items()}  # fmt: skip
        flagged = {
            args[i + 1]
            for i, a in enumerate(args[:-1])
            if re.fullmatch(r"--(ps-)?tls-[a-z-]+|--https-[a-z]+|--key-file", a)
        }
        copied = {f"/secrets/{a.rsplit('/', 1)[-1]}" for c in pod.get("initContainers", []) for a in c["command"]
                  if a.startswith("/secret-src/")}  # fmt: skip
        assert flagged <= copied, (obj["metadata"]["name"], flagged - copied)
        assert {f.rsplit("/", 1)[-1] for f in copied} <= in_secret, obj["metadata"]["name"]
    assert dialed and dialed <= names, dialed - names


@pytest.mark.parametrize("directory", ["base", "overlays/replicated"])
def test_one_streaming_trainer_and_the_joiners_read_the_kafka_bootstrap_from_one_configmap(directory):
    """The shard count is not the trainer's: one pod (one delta writer per version) with its state
    volume; the joiner and the trainer name the brokers by the ConfigMap recserve-kafka only."""
    objs = documents(KUBE / directory)
    by_name = {o["metadata"]["name"]: o for o in workloads(objs)}
    follow, join = by_name["follow"], by_name["join"]
    assert (follow["kind"], follow["spec"]["replicas"], join["kind"]) == ("StatefulSet", 1, "StatefulSet")
    (join_container,) = join["spec"]["template"]["spec"]["containers"]
    joiners = {e["name"]: e.get("value") for e in join_container["env"]}["JOINERS"]
    assert joiners == str(join["spec"]["replicas"])  # every partition has its member
    assert [t["metadata"]["name"] for t in follow["spec"]["volumeClaimTemplates"]] == ["state"]
    for workload, flag in ((follow, "--stream"), (join, "--brokers")):
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        args = container["args"]
        assert "$(KAFKA_BOOTSTRAP)" in args[args.index(flag) + 1]
        (env,) = [e for e in container["env"] if e["name"] == "KAFKA_BOOTSTRAP"]
        assert env["valueFrom"]["configMapKeyRef"] == {"name": "recserve-kafka", "key": "bootstrap"}
    args = follow["spec"]["template"]["spec"]["containers"][0]["args"]
    assert {"--train-dense", "--full-every", "--keep-versions", "--state"} <= set(args)
    assert args[args.index("--state") + 1].startswith("/state/")
