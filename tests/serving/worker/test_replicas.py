"""A shard served by several PS replicas (``serving.worker.replicas``): the ``--ps`` spec, and the
``ReplicaSet``'s routing and failover, unit-tested over stand-in replicas. Failover between real
PS processes killed with SIGKILL is in tests/serving/test_supervision.py."""

from __future__ import annotations

import numpy as np
import pytest

from serving.ps.client import ShardError
from serving.worker.replicas import ReplicaSet, format_ps_spec, parse_ps_spec
from serving.worker.server import WorkerServerConfig

SIGNS = np.arange(5, dtype=np.uint64)


def test_spec_lists_shards_by_comma_and_replicas_by_bar():
    spec = "127.0.0.1:7001|127.0.0.1:7002,127.0.0.1:7003"
    shards = parse_ps_spec(spec)
    assert shards == [["127.0.0.1:7001", "127.0.0.1:7002"], ["127.0.0.1:7003"]]
    assert parse_ps_spec(spec.split(",")) == shards  # as the --ps flag hands it over
    assert format_ps_spec(shards) == spec


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("a:1|,b:2", "shard 0 .* empty address"),
        ("a:1,,b:2", "shard 1 .* empty address"),
        ("a:1|b", "'b' is not HOST:PORT"),
        ("a:1|a:99999", "not HOST:PORT"),
        ("a:1|a:2,a:2", "a:2 is given twice .shard 0 and shard 1"),
    ],
)
def test_a_malformed_spec_is_refused_naming_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_ps_spec(spec)
    with pytest.raises(ValueError, match=message):  # `recserve worker --ps ...` says it at start
        WorkerServerConfig(ps=tuple(spec.split(",")))


class Replica:
    """A stand-in PS replica: its health, what it answers, and the calls it got."""

    def __init__(self, target: str, value: float, shard: int = 0):
        self.target, self.value, self.shard = target, value, shard
        self.timeout_s = 1.0
        self.status = "SERVING"
        self.error: ShardError | None = None
        self.calls: list[float | None] = []  # the timeout of each call

    def health(self) -> str:
        return self.status

    def stats(self, timeout_s=None) -> dict:
        return {"shard": self.shard, "num_shards": 2, "dim": 2}

    def rows(self, signs, insert, version="", timeout_s=None):
        self.calls.append(timeout_s)
        if self.error is not None:
            raise self.error
        return np.full((len(signs), 2), self.value, np.float32), ("v1", 3)

    def close(self) -> None:
        pass


def replica_set(n: int = 2) -> tuple[ReplicaSet, list[Replica]]:
    replicas = [Replica(f"r{i}", float(i)) for i in range(n)]
    rs = ReplicaSet(replicas, shard=0, num_shards=2)
    rs.check()
    return rs, replicas


def _answered_by(rs: ReplicaSet, calls: int = 1) -> list[float]:
    return [float(rs.rows(SIGNS, False, "v1")[0][0, 0]) for _ in range(calls)]


def test_lookups_go_round_robin_over_the_serving_replicas():
    rs, replicas = replica_set(3)
    assert sorted(_answered_by(rs, 6)) == [0, 0, 1, 1, 2, 2]
    replicas[1].status = "NOT_SERVING"
    rs.check()
    assert set(_answered_by(rs, 6)) == {0, 2}
    assert rs.health() == "SERVING" and rs.dim == 2


def test_an_unreachable_replica_fails_over_and_leaves_the_rotation_until_serving_again():
    rs, (r0, r1) = replica_set()
    r0.error = ShardError("PS shard r0 unavailable: UNAVAILABLE: connection reset", True, "UNAVAILABLE")
    assert _answered_by(rs, 4) == [1, 1, 1, 1]  # every call answered, by r1
    assert len(r0.calls) == 1 and rs.serving() == [1]  # r0 was tried once, then left out
    assert rs.failovers <= 1
    r0.error = None
    rs.check()  # its health says SERVING again
    assert sorted(_answered_by(rs, 4)) == [0, 0, 1, 1]


def test_a_replica_without_the_pinned_version_is_skipped_but_stays_in_the_rotation():
    rs, (r0, r1) = replica_set()
    r0.error = ShardError("embedding shard 0 of 2 does not hold version v1 (PS r0)", not_serving=True)
    assert _answered_by(rs, 4) == [1, 1, 1, 1]
    assert rs.serving() == [0, 1]  # it serves other versions: still asked for them


def test_a_bad_request_is_not_retried():
    rs, (r0, r1) = replica_set()
    r0.error = r1.error = ShardError(
        "PS shard failed: INVALID_ARGUMENT: bad signs", False, "INVALID_ARGUMENT"
    )
    with pytest.raises(ShardError, match="INVALID_ARGUMENT"):
        rs.rows(SIGNS, False)
    assert len(r0.calls) + len(r1.calls) == 1


def test_when_no_replica_answers_the_error_names_each_and_keeps_not_serving():
    rs, (r0, r1) = replica_set()
    r0.error = ShardError("shard 0 serves no version: none published (PS r0)", not_serving=True)
    r1.error = ShardError("shard 0 serves no version: none published (PS r1)", not_serving=True)
    r0.status = r1.status = "NOT_SERVING"
    rs.check()
    assert rs.health() == "NOT_SERVING"
    with pytest.raises(ShardError) as e:
        rs.rows(SIGNS, False)
    assert e.value.not_serving and e.value.grpc_status == "UNAVAILABLE"
    assert "no replica answered" in str(e.value) and "PS r0" in str(e.value) and "PS r1" in str(e.value)
    assert len(r0.calls) == len(r1.calls) == 1  # none known SERVING: each tried, for its reason


def test_each_attempt_gets_a_share_of_the_deadline():
    rs, (r0, r1) = replica_set()
    r0.error = r1.error = ShardError("PS shard unavailable: DEADLINE_EXCEEDED", True, "DEADLINE_EXCEEDED")
    with pytest.raises(ShardError, match="no replica answered"):
        rs.rows(SIGNS, False, timeout_s=0.5)
    first, second = r0.calls[0], r1.calls[0]  # the first lookup starts the rotation at r0
    assert 0.2 < first <= 0.25 and first < second <= 0.5  # half for the first, the rest for the other


def test_a_replica_of_another_shard_is_never_used():
    replicas = [Replica("r0", 0.0), Replica("r1", 1.0, shard=1)]
    rs = ReplicaSet(replicas, shard=0, num_shards=2)
    rs.check()
    assert rs.serving() == [0]
    assert "r1 WRONG_SHARD" in rs.describe()
    with pytest.raises(ValueError, match="r1 are not shard 0 of 2"):
        ReplicaSet(replicas, shard=0, num_shards=2).start(1.0)


def test_replicated_shards_do_not_take_updates_or_inserts():
    rs, _ = replica_set()
    with pytest.raises(ValueError, match="replicated"):
        rs.update(SIGNS, np.zeros((5, 2), np.float32))
    with pytest.raises(ValueError, match="does not insert"):
        rs.rows(SIGNS, True)


@pytest.mark.parametrize(
    ("spec", "message"),
    [("a:1|b", "'b' is not HOST:PORT"), ("a:1|a:99999", "not HOST:PORT"), ("a:1|a:1", "given twice")],
)
def test_a_malformed_worker_list_is_refused_at_start(spec, message):
    from serving.scoring.config import ScoringConfig
    from serving.worker.client import parse_workers

    with pytest.raises(ValueError, match=message):
        parse_workers(spec)
    with pytest.raises(ValueError, match=message):  # `recserve serve --worker ...` says it at start
        ScoringConfig(worker=spec)
