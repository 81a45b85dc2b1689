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


def test_the_small_overlay_applies_and_validates():
    objs = build_overlay(KUBE / "overlays" / "small")
    for obj in objs:
        kubernetes_validate.validate(obj, VERSION, strict=True)
    replicas = {o["metadata"]["name"]: o["spec"].get("replicas") for o in workloads(objs)}
    assert replicas["ps-r1"] == 0 and replicas["worker"] == 1
    topology = next(o for o in objs if o["kind"] == "ConfigMap")
    assert "|" not in topology["data"]["ps"]


def test_a_manifest_error_is_caught():
    """The validation can fail: a misspelt field in a copy of the PS StatefulSet is refused."""
    sts = copy.deepcopy(next(o for o in documents(KUBE / "base") if o["kind"] == "StatefulSet"))
    sts["spec"]["template"]["spec"]["containers"][0]["imagePullPolicy "] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, VERSION, strict=True)


def test_no_container_runs_as_root_or_unbounded():
    for obj in workloads(documents(KUBE / "base")):
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, obj["metadata"]["name"]
        assert pod["securityContext"]["runAsUser"] != 0
        for c in pod.get("initContainers", []) + pod["containers"]:
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], c["name"]
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], c["name"]


def test_the_worker_topology_names_every_ps_pod():
    """The workers' --ps lists pod <statefulset>-<shard>.ps for every shard of every PS StatefulSet,
    shards in order, and --num-shards matches the StatefulSets' replicas."""
    from serving.worker.replicas import parse_ps_spec

    objs = documents(KUBE / "base")
    stss = [o for o in objs if o["kind"] == "StatefulSet" and o["spec"]["serviceName"] == "ps"]
    topology = next(
        o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == "recserve-topology"
    )
    shards = parse_ps_spec(topology["data"]["ps"])
    for sts in stss:
        args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        num_shards = int(args[args.index("--num-shards") + 1])
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
    ps = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "ps")
    ps_args = ps["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--num-shards") + 1] == ps_args[ps_args.index("--num-shards") + 1]
    assert "--resume" in args and "--checkpoint-every" in args and "--max-restarts" in args


def test_the_documented_certificate_names_every_address_a_client_dials_and_pods_get_their_files():
    """docs/kubernetes.md's `recserve certs` line names every PS pod of the base topology, every worker
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
    objs = documents(KUBE / "base")
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
