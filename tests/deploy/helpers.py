"""What the deploy tests share: the manifests as objects, an overlay built from its base, and the
Grafana dashboard's panels and queries."""

from __future__ import annotations

import copy
import functools
import json
import shlex

import jsonpatch
import yaml

from tests.helpers import ROOT

KUBE = ROOT / "deploy" / "kubernetes"
GRAFANA = ROOT / "deploy" / "grafana" / "recserve.json"
IMAGE = ROOT / "deploy" / "image"
VERSION = "1.30"  # the oldest Kubernetes these manifests use features of (the preStop sleep action)


def documents(kustomization_dir):
    """The objects a kustomization builds, in order (``build``)."""
    return build(kustomization_dir)


def build(directory, objs: list | None = None) -> list:
    """The objects the kustomization (or, given ``objs`` to act on, the component) in ``directory``
    builds: its resources (files, or kustomizations built first), its components, then its patches
    (JSON6902), ``replicas``, ``nameSuffix``, ``labels`` and ``replacements``, in kustomize's
    order. These are the parts of kustomize the manifests use; any other field fails here. The
    Secret a ``secretGenerator`` makes is left to the roles test (it makes the files)."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "resources", "components", "secretGenerator", "replicas", "patches",
             "nameSuffix", "labels", "replacements"}  # fmt: skip
    assert set(kust) <= known, f"{directory}: kustomize fields this test does not apply: {set(kust) - known}"
    objs = [] if objs is None else objs
    for entry in kust.get("resources", []):
        path = (directory / entry).resolve()
        objs += (
            build(path)
            if path.is_dir()
            else [copy.deepcopy(d) for d in yaml.safe_load_all(path.read_text()) if d]
        )
    for entry in kust.get("components", []):
        build((directory / entry).resolve(), objs)
    for p in kust.get("patches", []):
        (target,) = [
            o
            for o in objs
            if (o["kind"], o["metadata"]["name"]) == (p["target"]["kind"], p["target"]["name"])
        ]
        patched = jsonpatch.JsonPatch(yaml.safe_load(p["patch"])).apply(target)
        target.clear()
        target.update(patched)
    for r in kust.get("replicas", []):
        targets = [o for o in objs if o["metadata"]["name"] == r["name"] and "replicas" in o.get("spec", {})]
        assert len(targets) == 1, f"replicas: {r['name']} names {len(targets)} workloads"
        targets[0]["spec"]["replicas"] = r["count"]
    for o in objs if "nameSuffix" in kust else []:
        o["metadata"]["name"] += kust["nameSuffix"]
    for pairs in (entry["pairs"] for entry in kust.get("labels", [])):
        for o in objs:
            o["metadata"].setdefault("labels", {}).update(pairs)
    for r in kust.get("replacements", []):
        source = _one(objs, r["source"])
        value = _path(source, r["source"]["fieldPath"])
        for target in r["targets"]:
            for o in (o for o in objs if _selects(o, target["select"])):
                for field in target["fieldPaths"]:
                    parent, key = _path(o, field.rsplit(".", 1)[0]), field.rsplit(".", 1)[1]
                    parent[key] = type(parent[key])(value)  # kustomize keeps the target's type
    return objs


def _selects(obj: dict, select: dict) -> bool:
    """kustomize's selector: kind, name, and a labelSelector of ``key=value`` terms joined by ','."""
    wanted = dict(term.split("=", 1) for term in select.get("labelSelector", "").split(",") if term)
    return (
        obj["kind"] == select["kind"]
        and select.get("name", obj["metadata"]["name"]) == obj["metadata"]["name"]
        and wanted.items() <= obj["metadata"].get("labels", {}).items()
    )


def _one(objs: list, select: dict) -> dict:
    (found,) = [o for o in objs if _selects(o, select)]
    return found


def _path(obj: dict, dotted: str):
    for key in dotted.split("."):
        obj = obj[key]
    return obj


def build_overlay(overlay):
    """The overlay's objects (``build``)."""
    return build(overlay)


def workloads(objs):
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet", "Job")]


def dashboard_panels() -> list[dict]:
    """The dashboard's panels that chart queries, in order: a collapsed row's (nested in it)
    included, the rows themselves (titles, no query) not."""
    out: list[dict] = []
    for p in json.loads(GRAFANA.read_text())["panels"]:
        out += p.get("panels", []) if p["type"] == "row" else [p]
    return out


def dashboard_queries() -> list[str]:
    """Every PromQL expression of the dashboard, panel by panel."""
    return [t["expr"] for p in dashboard_panels() for t in p["targets"]]


def instructions() -> dict[str, list[str]]:
    """The image's Containerfile: each instruction's arguments, in order (continued lines joined)."""
    text = (IMAGE / "Containerfile").read_text().replace("\\\n", " ")
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            out.setdefault(word, []).append(rest.strip())
    return out


@functools.cache
def image_env() -> dict[str, str]:
    """The environment the image's ENV instructions give every container (``NAME=value`` pairs;
    read once: callers copy it)."""
    return dict(pair.split("=", 1) for env in instructions()["ENV"] for pair in shlex.split(env))
