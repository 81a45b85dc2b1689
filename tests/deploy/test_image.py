"""deploy/image: what the manifests assume of the image is what the Containerfile builds (uid,
WORKDIR, the commands on PATH), and the build scripts parse. `make test-image` builds and runs it."""

from __future__ import annotations

import re
import subprocess

from tests.deploy.helpers import IMAGE, KUBE, documents, instructions, workloads
from tests.helpers import ROOT


def test_the_image_runs_as_the_manifests_user_in_their_workdir():
    ins = instructions()
    assert ins["USER"] == ["10001:10001"] and ins["WORKDIR"] == ["/app"]
    for obj in workloads(documents(KUBE / "base")):
        ctx = obj["spec"]["template"]["spec"]["securityContext"]
        assert (ctx["runAsUser"], ctx["runAsGroup"]) == (10001, 10001), obj["metadata"]["name"]
        for c in obj["spec"]["template"]["spec"]["containers"]:
            assert c["image"] == "recserve:latest" and c["command"][0] in ("recserve", "torchrun"), c["name"]


def test_the_image_installs_from_bind_mounted_wheels_without_a_cache_then_warms_numba():
    ins = instructions()
    run, warm = ins["RUN"]
    assert "recserve warm" in warm and "NUMBA_CACHE_DIR=/opt/recserve/numba-cache" in " ".join(ins["ENV"])
    assert "--mount=type=bind,source=build/image/wheels" in run
    assert "--no-cache-dir" in run and "--no-index" in run
    assert re.search(r"install .* 'recserve' ", run)  # no extras: TorchServe is not an image role
    ignore = (ROOT / ".containerignore").read_text().split()
    assert {"*", "!data", "!build/image/wheels"} <= set(ignore)


def test_the_torchserve_image_is_the_lean_image_plus_java_and_torchserve():
    """Containerfile.torchserve starts from the lean image (build.sh --torchserve passes it) and adds
    Debian's Java 17 and recserve[serve] from the same wheels, then runs as the manifests' user."""
    text = (IMAGE / "Containerfile.torchserve").read_text()
    assert "FROM $LEAN" in text and "LEAN=localhost/recserve:latest" in (IMAGE / "build.sh").read_text()
    assert "openjdk-17-jre-headless" in text and "'recserve[serve]'" in text and "--no-cache-dir" in text
    assert text.rstrip().endswith("USER 10001:10001")


def test_the_build_scripts_parse():
    for script in ("build.sh", "test.sh"):
        done = subprocess.run(["bash", "-n", str(IMAGE / script)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
