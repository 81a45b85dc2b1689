"""What the deploy tests share: the manifests as objects, an overlay built from its base."""

from __future__ import annotations

import copy

import jsonpatch
import yaml

from tests.helpers import ROOT

KUBE = ROOT / "deploy" / "kubernetes"
VERSION = "1.30"  # the oldest Kubernetes these manifests use features of (the preStop sleep action)


def documents(kustomization_dir):
    """Every object the ``resources`` of a kustomization name (recursively), in order."""
    kust = yaml.safe_load((kustomization_dir / "kustomization.yaml").read_text())
    out = []
    for entry in kust.get("resources", []):
        path = (kustomization_dir / entry).resolve()
        if path.is_dir():
            out += documents(path)
        else:
            out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def build_overlay(overlay):
    """The overlay's objects: its base with ``replicas`` and JSON6902 ``patches`` applied (the
    parts of kustomize the overlay uses; anything else in it fails here)."""
    kust = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    known = {"apiVersion", "kind", "resources", "secretGenerator", "replicas", "patches"}
    assert set(kust) <= known, f"kustomize fields this test does not apply: {set(kust) - known}"
    objs = copy.deepcopy(documents(overlay))
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    for r in kust.get("replicas", []):
        targets = [o for (kind, name), o in by_name.items() if name == r["name"] and "replicas" in o["spec"]]
        assert len(targets) == 1, f"replicas: {r['name']} names {len(targets)} workloads"
        targets[0]["spec"]["replicas"] = r["count"]
    for p in kust.get("patches", []):
        target = by_name[(p["target"]["kind"], p["target"]["name"])]
        patched = jsonpatch.JsonPatch(yaml.safe_load(p["patch"])).apply(target)
        target.clear()
        target.update(patched)
    return objs


def workloads(objs):
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet", "Job")]
