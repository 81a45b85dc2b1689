"""Never serve nothing: real `recserve ps-serve` and `recserve worker` processes on free loopback
ports, and the scoring core in this process against them. Before any version is published, and
while the published one is refused, the PS and the worker say NOT_SERVING on gRPC health, lookups
are UNAVAILABLE naming the shard and why, and scoring answers 503 with that reason; once a good
version is published every part serves it. `recserve up` on a version every shard refuses exits
non-zero with each shard's reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pytest

from model_store.releases import publish
from serving.ps.client import ShardError
from serving.rpc.errors import NotServing
from serving.rpc.health import check, wait_serving
from serving.scoring.core import JSON, Scorer
from serving.scoring.loop import score
from tests.helpers import ROOT, wait_until
from tests.serving.helpers import DIM, SIGNS, make_version, ranking_batch, remote_scorer

pytestmark = pytest.mark.slow


def _score(scorer: Scorer) -> tuple[int, dict]:
    status, payload, *_ = score(
        scorer, orjson.dumps({"context": {"user": "u1"}, "items": [{"item": "i1", "x": 1.0}]}), JSON
    )
    return status, orjson.loads(payload)


def _wait_status(channel, want: str, timeout_s: float = 10.0) -> None:
    """Until health says ``want`` (the worker checks its shards every 0.1 s here)."""
    wait_until(lambda: check(channel) == want, timeout_s, f"health {want}")


def test_before_any_version_nothing_serves_then_the_published_version_does(ps_and_worker):
    root, ps, worker = ps_and_worker
    assert check(ps.channel, timeout_s=10) == "NOT_SERVING"  # an answer, however busy the box
    with pytest.raises(ShardError) as err:
        ps.lookup(SIGNS[:3])
    assert err.value.not_serving and err.value.code == "UNAVAILABLE"
    assert "embedding shard 0 of 1 serves no version: no version published yet for model m" in str(err.value)
    st = ps.stats()
    assert st["version"] == "" and st["refusal"] == ""
    _wait_status(worker.channel, "NOT_SERVING")
    with pytest.raises(NotServing, match="embedding shard 0 of 1 serves no version: no version published"):
        worker.forward(ranking_batch())
    version = make_version(root)  # sealed, not yet published: scoring serves its dense side
    scorer = remote_scorer(root, version, worker)
    status, body = _score(scorer)
    assert status == 503, body
    assert body["error"].startswith("embedding shard 0 of 1 serves no version: no version published yet")

    publish(root, "m", version)
    wait_serving(ps.channel, timeout_s=10)
    rows, _ = ps.lookup(SIGNS[:3])
    assert rows.shape == (3, DIM) and np.abs(rows).sum() > 0  # the version's rows, not default zeros
    assert ps.stats()["version"] == version
    # a serving shard is numpy only: no numba/LLVM in the process (~120 MB of RSS each)
    maps = Path(f"/proc/{ps.pid}/maps")
    if maps.exists():
        assert "llvmlite" not in maps.read_text()
    wait_serving(worker.channel, timeout_s=10)
    status, body = _score(scorer)
    assert status == 200, body
    assert body["versions"]["embedding"] == version and len(body["scores"]) == 1
    scorer.close()


def test_a_refused_version_is_not_served_and_every_layer_says_why(ps_and_worker):
    root, ps, worker = ps_and_worker
    version = make_version(root, rows_dim=8)  # the shard is dim 4: refused
    publish(root, "m", version)
    reason = f"not switching to version {version}: "
    st = wait_until(lambda: (s := ps.stats())["refusal"] and s, 10, "a refusal")  # polls every 0.1 s
    assert st["refusal"].startswith(reason) and "dim 8 does not match the store's dim 4" in st["refusal"]
    assert st["version"] == "" and check(ps.channel, timeout_s=10) == "NOT_SERVING"
    with pytest.raises(ShardError, match="dim 8 does not match"):
        ps.lookup(SIGNS[:3])
    _wait_status(worker.channel, "NOT_SERVING")
    scorer = remote_scorer(root, version, worker)
    status, body = _score(scorer)
    scorer.close()
    assert status == 503, body
    assert body["error"].startswith(f"embedding shard 0 of 1 serves no version: {reason}")
    assert "dim 8 does not match the store's dim 4" in body["error"]


def test_up_on_a_version_every_shard_refuses_exits_nonzero_with_each_reason(tmp_path):
    root = tmp_path / "store"
    version = make_version(root, rows_dim=8)
    publish(root, "m", version)
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "recserve", "up", "--store", str(root), "--model", "m", "--ps-shards", "2",
            "--run-dir", str(run_dir), "--http-port", "0", "--management-port", "0", "--metrics-port", "0",
            "--startup-timeout-s", "60"]  # fmt: skip
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0, run.stdout
    assert "serving" not in run.stdout
    err = run.stderr
    assert f"m version {version} is not served by every PS shard" in err, err
    for shard in (0, 1):
        line = next(x for x in err.splitlines() if x.strip().startswith(f"ps shard {shard} "))
        assert f"not switching to version {version}" in line and "dim 8 does not match" in line, err
    assert not (run_dir / "stack.json").exists()  # up stopped what it started


def test_lookups_name_their_version_and_a_switch_keeps_the_old_one_for_them(ps_and_worker):
    """Version-pinned over real processes: after a switch, the scorer of the old dense version
    still reads the old rows (the shard keeps them), the new one the new rows; a version the shard
    never held is a 503 naming the shard and what it holds, never another version's rows."""
    root, ps, worker = ps_and_worker
    v1 = make_version(root)
    publish(root, "m", v1)
    wait_serving(worker.channel, timeout_s=10)
    old = remote_scorer(root, v1, worker)
    status, before = _score(old)
    assert status == 200 and before["versions"]["embedding"] == v1, before
    v2 = make_version(root, seed=1)  # other rows
    publish(root, "m", v2)
    wait_until(lambda: ps.stats()["version"] == v2, 10, f"the shard on version {v2}")
    assert ps.stats()["held"] == [(v2, -1), (v1, -1)]
    rows1, _ = ps.lookup(SIGNS[:5], version=v1)
    rows2, _ = ps.lookup(SIGNS[:5], version=v2)
    assert not np.array_equal(rows1, rows2)  # two versions, each its own rows
    with pytest.raises(ShardError) as err:  # a serving shard never inserts, pinned or not
        ps.lookup(SIGNS[:5], insert=True, version=v1)
    assert err.value.code == "INVALID_ARGUMENT" and "does not insert" in str(err.value)
    status, body = _score(old)
    assert status == 200 and body["versions"]["embedding"] == v1 == body["versions"]["dense"], body
    assert body["scores"] == before["scores"]
    new = remote_scorer(root, v2, worker)
    status, body = _score(new)
    assert status == 200 and body["versions"]["shards"] == [[v2, -1]], body
    v3 = make_version(root)  # sealed, never published: no shard holds it
    unheld = remote_scorer(root, v3, worker)
    status, body = _score(unheld)
    assert status == 503, body
    assert body["error"].startswith(
        f"embedding shard 0 of 1 does not hold version {v3} (it holds {v2}, {v1})"
    )
    for s in (old, new, unheld):
        s.close()
