"""Two hosts (network namespaces, the store mounted on each) serve one experiment: a unit gets the
same arm on both, each response is scored by its arm's version only; and when the streaming
trainer's output guard rewinds the served rows to the last good delta (a delta like any other,
``training.follow.revert``), both hosts serve the good delta's scores again."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest

from loadtest.common import train_version
from loadtest.drive import request_bodies
from loadtest.processes import venv_env
from model_store import experiments as ex
from tests.helpers import ROOT, wait_until
from training.follow.cut import DeltaWriter
from training.follow.revert import revert

pytestmark = pytest.mark.slow
MOUNT = "/mnt/recserve"
PORT = 8080


def score(host, body: bytes, unit: str) -> dict:
    req = urllib.request.Request(f"http://{host.address}:{PORT}/predictions/criteo", data=body, method="POST",
                                 headers={"Content-Type": "application/json", "X-Request-Id": unit})  # fmt: skip
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def up(host) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host.address}:{PORT}/ping", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_two_hosts_split_units_alike_and_both_serve_the_rewind(network, tmp_path, trained_copy):
    store = tmp_path / "store"
    trained_copy(store)  # version 1: CURRENT, control
    train_version(store, seed=1, publish=False)  # version 2: the candidate
    net = network(2, ["serve-a", "serve-b"])
    for h in net.hosts:
        h.popen(["recserve", "serve", "--workers", "1", "--host", h.address, "--port", str(PORT), "--store", MOUNT, "--model", "criteo",
                 "--lookups", "colocated", "--no-token-auth", "--poll-s", "0.5"],
                tmp_path / f"{h.name}.log", env=venv_env(), binds={str(store): MOUNT}, cwd=ROOT)  # fmt: skip
    wait_until(lambda: all(up(h) for h in net.hosts), 180, "both hosts serving")
    body = request_bodies()[0]
    ex.start(store, "criteo", "hosts", [("2", 0.5)], salt="s")
    wait_until(lambda: all("arm" in score(h, body, "probe")["versions"] for h in net.hosts), 60,
               "both hosts serving the experiment")  # fmt: skip
    arms: dict[str, str] = {}
    for u in range(40):
        a, b = (score(h, body, f"user-{u}")["versions"] for h in net.hosts)
        assert a["arm"] == b["arm"], (u, a, b)  # one unit, one arm, on every host
        for v in (a, b):
            assert v["embedding"] == v["dense"] == ("2" if v["arm"] == "A" else "1"), v  # never mixed
        arms[f"user-{u}"] = a["arm"]
    assert set(arms.values()) == {"control", "A"}, arms
    unit = next(u for u, arm in arms.items() if arm == "control")  # scored by version 1, which gets deltas

    writer = DeltaWriter(store, "criteo", "1")
    signs, rng = writer.signs(), np.random.default_rng(0)

    def at(seq: int) -> list[np.ndarray]:
        def served():
            replies = [score(h, body, unit) for h in net.hosts]
            ok = all(r["versions"]["delta_seq"] == seq for r in replies)
            return ok and [np.asarray(r["scores"]) for r in replies]

        return wait_until(served, 60, f"both hosts serving delta {seq}")

    writer.assign(signs[:200], rng.normal(0, 0.05, (200, writer.dim)))
    good, _, _ = writer.publish()
    before = at(good)
    writer.assign(signs[:2000], rng.normal(0, 1.0, (2000, writer.dim)))  # trained on a bad stretch
    bad, _, _ = writer.publish()
    assert not np.allclose(at(bad)[0], before[0])
    revert(writer.vdir, writer.stores, good)
    rewound, _, _ = writer.publish()
    after = at(rewound)
    for b, a in zip(before, after, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)  # every host back on the good delta
