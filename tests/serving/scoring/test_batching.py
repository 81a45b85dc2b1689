"""Micro-batching of the dense stage (serving/scoring/batching.py ``DenseBatcher``) over a real Scorer
of a trained version (co-located lookups): requests that queue run the dense model together and
each gets exactly the reply it gets alone; a request alone never waits; a run waits at most
``wait_s`` for a request still in progress; requests of two versions never share a run."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import orjson
import pytest

from serving.scoring.batching import DenseBatcher
from serving.scoring.client import requests_from_file
from serving.scoring.config import ScoringConfig
from serving.scoring.core import Scorer
from serving.scoring.errors import Reply
from serving.scoring.lean import Frontend, ServeConfig
from serving.scoring.loop import Pending, prepare, reply_of, score
from tests.serving.helpers import TEST

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def scorer(trained):
    s = Scorer(ScoringConfig(trained[1].version_dir, lookups="colocated"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def bodies():
    return list(requests_from_file(TEST, "data/schemas/criteo.yaml", 50, 200))  # 4 requests of 50 items


def _batched_runs(frontend: Frontend) -> list[float]:
    """[requests over all runs, runs] from the batch-size histogram."""
    metrics = {m.name: m for m in frontend.registry.collect()}
    samples = {s.name: s.value for s in metrics["recserve_scoring_dense_batch_requests"].samples}
    return [
        samples["recserve_scoring_dense_batch_requests_sum"],
        samples["recserve_scoring_dense_batch_requests_count"],
    ]


def _frontend(tmp_path: Path) -> Frontend:
    return Frontend(ServeConfig(store=str(tmp_path), disable_token_auth=True))


def _scores(reply: Reply) -> list[float]:
    assert reply.status == 200, reply.payload
    return orjson.loads(reply.payload)["scores"]


def _looked_up(scorer: Scorer, body: bytes, ctype: str | None) -> Pending:
    pending = prepare(scorer, body, ctype)
    assert isinstance(pending, Pending), pending
    return pending


async def _dense(batcher: DenseBatcher, frontend: Frontend | None, pending: Pending) -> Reply:
    """What the lean frontend does with a run's Outcome: its reply, counted."""
    reply = reply_of(await batcher.dense(pending))
    return frontend.record(pending.scorer, reply) if frontend is not None else reply


def test_queued_requests_share_one_dense_run_and_each_gets_its_own_reply(scorer, bodies, tmp_path):
    frontend = _frontend(tmp_path)
    alone = [_scores(score(scorer, b, c)) for b, c in bodies]

    async def main() -> list[Reply]:
        batcher = DenseBatcher(30.0, 10_000, frontend.batched.observe)
        for _ in bodies:  # every request has begun before the first one's lookups are done
            batcher.begin()
        joined = [
            asyncio.ensure_future(_dense(batcher, frontend, _looked_up(scorer, b, c))) for b, c in bodies
        ]
        return list(await asyncio.wait_for(asyncio.gather(*joined), 10))

    replies = asyncio.run(main())
    assert [_scores(r) for r in replies] == [pytest.approx(a, abs=1e-6) for a in alone]
    assert {r.versions["dense"] for r in replies} == {scorer.dense_version}
    assert all(set(r.timings) == {"decode", "worker", "dense", "encode", "total"} for r in replies)
    assert _batched_runs(frontend) == [len(bodies), 1]  # one run of all four


def test_a_request_alone_never_waits_and_a_run_waits_at_most_wait_s(scorer, bodies, tmp_path):
    frontend = _frontend(tmp_path)
    (b0, c0), (b1, c1) = bodies[:2]

    async def alone() -> Reply:
        batcher = DenseBatcher(30.0, 10_000, frontend.batched.observe)
        batcher.begin()
        return await asyncio.wait_for(_dense(batcher, frontend, _looked_up(scorer, b0, c0)), 5)  # not 30 s

    assert _scores(asyncio.run(alone())) == pytest.approx(_scores(score(scorer, b0, c0)), abs=1e-6)

    async def one_never_joins() -> float:
        batcher = DenseBatcher(0.05, 10_000, frontend.batched.observe)
        batcher.begin()
        batcher.begin()  # in progress, and it never joins: the first runs after wait_s
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(_dense(batcher, frontend, _looked_up(scorer, b1, c1)), 5)
        return loop.time() - t0

    assert 0.05 <= asyncio.run(one_never_joins()) < 5

    async def the_other_leaves() -> Reply:
        batcher = DenseBatcher(30.0, 10_000, frontend.batched.observe)
        batcher.begin()
        batcher.begin()
        joined = asyncio.ensure_future(_dense(batcher, frontend, _looked_up(scorer, b0, c0)))
        await asyncio.sleep(0)  # it has joined and waits for the other
        assert not joined.done()
        batcher.end()  # the other was refused (say, a 400): nothing left to wait for
        return await asyncio.wait_for(joined, 5)

    assert asyncio.run(the_other_leaves()).status == 200


def test_two_versions_never_share_a_run_and_a_failed_run_fails_its_requests_only(
    scorer, bodies, trained, tmp_path
):
    frontend = _frontend(tmp_path)
    other = Scorer(ScoringConfig(trained[1].version_dir, lookups="colocated"))  # another scorer object
    try:
        (b0, c0), (b1, c1) = bodies[:2]

        async def both() -> list[Reply]:  # queued together: one of each scorer
            batcher = DenseBatcher(30.0, 10_000, frontend.batched.observe)
            batcher.begin()
            batcher.begin()
            first = asyncio.ensure_future(_dense(batcher, frontend, _looked_up(scorer, b0, c0)))
            second = asyncio.ensure_future(_dense(batcher, frontend, _looked_up(other, b1, c1)))
            return list(await asyncio.wait_for(asyncio.gather(first, second), 10))

        replies = asyncio.run(both())
        assert [r.status for r in replies] == [200, 200]
        assert _batched_runs(frontend) == [2, 2]  # two runs of one

        def broken(*_):
            raise RuntimeError("dense runtime crashed")

        other.dense = broken
        ok, bad = asyncio.run(both())
        assert ok.status == 200
        assert bad.status == 500 and b"dense runtime crashed" in bad.payload
    finally:
        other.close()


def test_a_run_never_holds_more_than_max_items(scorer, bodies):
    alone = [_scores(score(scorer, b, c)) for b, c in bodies]
    runs: list[int] = []  # requests per run

    async def main() -> list[Reply]:  # four requests of 50 items, at most 120 items a run
        batcher = DenseBatcher(30.0, 120, observe=runs.append)
        for _ in bodies:
            batcher.begin()
        joined = [asyncio.ensure_future(_dense(batcher, None, _looked_up(scorer, b, c))) for b, c in bodies]
        return list(await asyncio.wait_for(asyncio.gather(*joined), 10))

    replies = asyncio.run(main())
    assert [_scores(r) for r in replies] == [pytest.approx(a, abs=1e-6) for a in alone]
    assert runs == [2, 2]  # 100 + 100 items, never 150


def test_a_run_whose_observer_fails_answers_every_request(scorer, bodies):
    def observe(_):
        raise RuntimeError("metrics broke")

    async def main() -> list:
        batcher = DenseBatcher(30.0, 10_000, observe)
        for _ in bodies:
            batcher.begin()
        joined = [asyncio.ensure_future(_dense(batcher, None, _looked_up(scorer, b, c))) for b, c in bodies]
        return list(await asyncio.wait_for(asyncio.gather(*joined, return_exceptions=True), 10))

    answers = asyncio.run(main())  # none left waiting: wait_for would time out
    assert [str(a) for a in answers] == ["metrics broke"] * len(bodies)


def test_micro_batch_scores_equal_the_dense_model_on_each_request(scorer, bodies):
    inputs = [_looked_up(scorer, b, c).inputs for b, c in bodies]
    together = scorer.predict(inputs)
    for one, p in zip(inputs, together, strict=True):
        assert p.shape == (len(one.pooled),)
        np.testing.assert_allclose(p, scorer.predict([one])[0], atol=1e-6)


def test_a_negative_wait_is_refused_at_start(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "recserve", "serve", "--store", str(tmp_path), "--batch-wait-ms", "-1"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and "--batch-wait-ms must be >= 0" in done.stderr, done.stderr
