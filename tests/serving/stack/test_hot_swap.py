"""Hot swap on the live stack: a delta goes live and changes scores; a corrupt delta is refused
while serving continues; a new full version swaps embeddings and dense; rollback restores the
earlier scores exactly."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import orjson
import pytest

import model_store as ms
from features import stream
from features.schema import load_schema
from features.transform import transform
from model_store.releases import publish, rollback
from serving.scoring.client import ScoringClient, requests_from_file
from tests.helpers import second_half, train_version, wait_until
from tests.serving.helpers import TEST
from training.follow.cut import DeltaWriter

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(trained, start_stack):
    root = trained[0]
    # statuses, not latency: every reply across a switch must be a 200, and the handler's 1 s
    # default deadline on the worker can expire on a busy 2-core CI box while a version maps
    stack = start_stack(root, "criteo", disable_token_auth=True, poll_s=0.2, worker_timeout_s=10.0)
    client = ScoringClient(stack.state.endpoint)
    yield root, stack, client
    client.close()


def _score(client, limit=400, every=False):
    """Scores of the first ``limit`` test rows and the versions of the last reply (of every
    reply with ``every``: each request names the versions that produced it)."""
    scores, versions = [], []
    for body, ctype in requests_from_file(TEST, "data/schemas/criteo.yaml", 200, limit):
        status, payload = client.post(body, ctype)
        assert status == 200, payload
        reply = orjson.loads(payload)
        scores.extend(reply["scores"])
        versions.append(reply["versions"])
    return np.array(scores), versions if every else versions[-1]


def _wait(client, pred, timeout=20.0):
    """Score until every reply of one round satisfies ``pred`` (the swap has fully landed); that
    round's scores and the versions of its last reply."""
    rounds = []

    def landed() -> bool:
        rounds.append(_score(client, every=True))
        return all(pred(v) for v in rounds[-1][1])

    try:
        wait_until(landed, timeout, "the swap landed in every reply of a round")
    except AssertionError as e:
        raise AssertionError(f"{e}: {rounds[-1][1]}") from None
    scores, versions = rounds[-1]
    return scores, versions[-1]


def _dense(reply: tuple) -> str:
    """The dense version a scoring loop's reply (k, status, payload) names ('' for a failure)."""
    _, status, payload = reply
    return orjson.loads(payload)["versions"]["dense"] if status == 200 else ""


def test_delta_goes_live_and_changes_scores(live):
    root, stack, client = live
    before, versions = _score(client)
    assert versions["embedding"] == "1" and versions["dense"] == "1"
    writer = DeltaWriter(root, "criteo")
    schema = load_schema(ms.version_dir(root, "criteo", "1") / "schema.yaml")
    signs = transform(stream.read(TEST, schema, limit=400), schema).signs  # the rows these requests use
    writer.assign(signs, writer.lookup(signs) * 3.0 + 0.05)
    seq, _, _ = writer.publish()
    after, versions = _wait(client, lambda v: v["delta_seq"] == seq)
    assert versions["embedding"] == "1"
    assert np.abs(after - before).max() > 1e-3


def test_corrupt_delta_is_refused_and_serving_continues(live):
    root, stack, client = live
    before, versions = _score(client)
    writer = DeltaWriter(root, "criteo")
    writer.assign(writer.signs()[:100], np.full((100, writer.dim), 9.0, np.float32))

    def corrupt(ddir: Path) -> None:  # before its _SUCCESS: the shards read a delta at its notice
        victim = next(ddir.rglob("rows.npy"))
        victim.write_bytes(victim.read_bytes()[:-4] + b"\xff\xff\xff\xff")

    seq, _, _ = writer.publish(record=corrupt)
    logs = sorted((Path(stack.run_dir) / "logs").glob("ps*.log"))
    refused = f"delta {seq} of version 1 refused"  # by every shard: one part is corrupt, all refuse
    wait_until(lambda: all(refused in log.read_text() for log in logs), 30, f"'{refused}' in {logs}")
    after, now = _score(client)
    assert now["delta_seq"] == versions["delta_seq"] < seq
    assert np.array_equal(after, before)


def test_full_version_switch_then_rollback_restores_scores(live):
    """A version retrained on other data goes live; a scoring loop runs across the switch: no
    response pairs one version's embeddings with another's dense network, and each equals the
    scores of the version it names."""
    import threading

    root, stack, client = live
    before, _ = _score(client)
    bodies = list(requests_from_file(TEST, "data/schemas/criteo.yaml", 200, 400))
    replies, stop = [], threading.Event()

    def loop():  # scores while the version switches under it (its own connection)
        own = ScoringClient(stack.state.endpoint)
        while not stop.is_set():
            for k, (body, ctype) in enumerate(bodies):
                status, payload = own.post(body, ctype)
                replies.append((k, status, payload))
        own.close()

    result = train_version(
        root, 1, False, data=second_half(root.parent)
    )  # the daily retrain: same schema file
    v2 = ms.versions(root, "criteo")[-1]
    m1, m2 = (ms.read_manifest(ms.version_dir(root, "criteo", v), verify=False) for v in ("1", v2))
    assert m1.schema_fingerprint == m2.schema_fingerprint
    assert m1.model_config["dense_mean"] != m2.model_config["dense_mean"]
    looping = threading.Thread(target=loop)
    looping.start()
    try:
        wait_until(lambda: replies, 60, "the loop's first reply (version 1)")
        publish(root, "criteo", v2)
        new, versions = _wait(client, lambda v: v["embedding"] == v2 and v["dense"] == v2, timeout=60)
        wait_until(lambda: _dense(replies[-1]) == v2, 60, f"the loop's replies of version {v2}")
    finally:
        stop.set()
        looping.join()
    offline = np.load(f"{result.version_dir}/eval/scores.npy")[: len(new)]
    assert np.abs(new - offline).max() <= 1e-5  # the new version scores as it did in evaluation
    expected = {"1": before, v2: offline}
    seen = {"1": 0, v2: 0}
    for k, status, payload in replies:
        assert status == 200, payload
        reply = orjson.loads(payload)
        v = reply["versions"]
        assert v["embedding"] == v["dense"] and {s for s, _ in v["shards"]} == {v["dense"]}, v
        want = expected[v["dense"]][200 * k : 200 * (k + 1)]
        assert np.abs(np.array(reply["scores"]) - want).max() <= 1e-5, (k, v)
        seen[v["dense"]] += 1
    assert seen["1"] and seen[v2], seen  # the loop did span the switch
    assert rollback(root, "criteo") == "1"
    back, versions = _wait(client, lambda v: v["embedding"] == "1" and v["dense"] == "1", timeout=60)
    diff = np.abs(back - before)
    assert diff.max() <= 1e-6, f"{(diff > 1e-6).sum()} of {len(diff)} scores differ, max {diff.max()}"


def test_a_version_bigger_than_the_old_capacity_is_served(live):
    """Version 1's rows plus 1.2M more (more than the 1M rows a serving shard used to hold at
    most): the PS shards map it and serve it, and it scores as version 1 did in evaluation (the
    requests do not use the added IDs; version 1's deltas are not part of the copy)."""
    import shutil

    from model_store.shards import read_shard, write_shard

    root, stack, client = live
    v1 = ms.version_dir(root, "criteo", "1")
    big = ms.next_version(root, "criteo")
    staging = ms.staging_dir(root, "criteo", big)
    for p in v1.iterdir():
        if p.name not in ("embeddings", "deltas", ms.SUCCESS, "MANIFEST.json"):
            (shutil.copytree if p.is_dir() else shutil.copy2)(p, staging / p.name)
    rng = np.random.default_rng(5)
    for part in sorted((v1 / "embeddings").iterdir()):
        data = read_shard(part)
        n = 1_200_000 // data.meta.num_shards + 1
        from features.hashing import shard_of

        extra = rng.integers(2**62, 2**63, 3 * n, dtype=np.uint64)
        extra = extra[shard_of(extra, data.meta.num_shards) == data.meta.shard][:n]
        data.meta = replace(data.meta, version=big)
        data.signs = np.concatenate([data.signs, extra])
        data.rows = np.concatenate(
            [data.rows, rng.standard_normal((n, data.rows.shape[1])).astype(data.rows.dtype)]
        )
        data.state = {
            k: np.concatenate([v, np.zeros((n, v.shape[1]), v.dtype)]) for k, v in data.state.items()
        }
        data.stamp = np.concatenate([data.stamp, np.zeros(n, np.uint32)])
        data.count = np.concatenate([data.count, np.zeros(n, np.uint32)])
        write_shard(staging / "embeddings", data)
    ms.write_manifest(staging, replace(ms.read_manifest(v1, verify=False), version=big))
    ms.seal(staging, ms.version_dir(root, "criteo", big))
    publish(root, "criteo", big)
    from serving.ps.client import PSClient

    def on_big() -> list[dict] | None:
        stats = []
        for target in stack.state.ps:
            with PSClient(target) as ps:
                stats.append(ps.stats())
        return stats if all(s["version"] == big for s in stats) else None

    stats = wait_until(on_big, 60, f"every shard serving version {big}")
    assert sum(s["rows"] for s in stats) >= 1_200_000, stats
    after, versions = _wait(client, lambda v: v["embedding"] == big and v["dense"] == big, timeout=60)
    offline = np.load(v1 / "eval" / "scores.npy")[: len(after)]
    assert np.abs(after - offline).max() <= 1e-5
    rollback(root, "criteo")
