"""Canary for full versions from the stream (training/follow/canary.py: ``recserve train --follow
--stream ... --full-every ... --canary-share``) against the mock Kafka cluster: a full version goes
to a canary arm, not to CURRENT; the rule's promotion makes it CURRENT and the trainer follows it;
an abort drops it (CURRENT never moved), counted, and the next full version is canaried."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import model_store as ms
from model_store import experiments as ex
from tests.helpers import free_port, wait_until
from tests.training.follow.helpers import NAME, schema_of, stream_cfg
from tests.training.sources.samples import produce, records
from training.follow.canary import name_of
from training.follow.config import FollowConfig
from training.follow.trainer import FollowTrainer

pytestmark = pytest.mark.filterwarnings(
    "ignore:.*torch.jit.load. is deprecated", "ignore::DeprecationWarning"
)

FULL = "recserve_follow_full_versions_total"


@pytest.mark.parametrize("share", [-0.1, 0.6, float("nan")])
def test_canary_share_is_refused_outside_0_to_half_and_without_full_every(share):
    with pytest.raises(ValueError, match=r"--canary-share must be in \[0, 0.5\]"):
        FollowConfig(follow="a/m", stream="kafka://h:1/t", full_every="2d", canary_share=share)
    with pytest.raises(ValueError, match="--canary-share needs --full-every"):
        FollowConfig(follow="a/m", stream="kafka://h:1/t", canary_share=0.1)
    assert (
        FollowConfig(follow="a/m", stream="kafka://h:1/t", full_every="2d", canary_share=0.5).canary_share
        == 0.5
    )


def _count(trainer: FollowTrainer, outcome: str) -> float:
    assert trainer.book.registry is not None
    return trainer.book.registry.get_sample_value(FULL, {"outcome": outcome}) or 0.0


def _canary(store: Path, version: str) -> ex.Experiment | None:
    """The model's experiment when it is ``version``'s canary, running."""
    exp = ex.read_experiment(store, NAME)
    return exp if exp is not None and exp.running and exp.name == name_of(version) else None


@contextlib.contextmanager
def _trainer(store: Path, topic: str, kafka) -> Iterator[FollowTrainer]:
    """A trainer of ``topic`` with a full version every 2 deltas (a delta every step of 32
    samples), each a canary of share 0.1, running in a thread until the block ends (the sample
    file has 200 rows: three bursts of 64)."""
    cfg = stream_cfg(store, f"kafka://{kafka.bootstrap}/{topic}", delta_interval_s=1e-9, full_every="2d", batch_size=32,
                     canary_share=0.1, metrics_port=free_port())  # fmt: skip
    stop, failed = threading.Event(), []

    def run() -> None:
        try:
            trainer.run(stop)
        except BaseException as e:  # raised in the test's thread below
            failed.append(e)

    with FollowTrainer(cfg) as trainer:
        thread = threading.Thread(target=run, name="follow", daemon=True)
        thread.start()
        try:
            yield trainer
        finally:
            stop.set()
            thread.join(120)
    assert not thread.is_alive() and not failed, failed


def test_a_canary_promoted_by_the_rule_becomes_current_and_is_followed(kafka, new_topic, store):
    topic = new_topic("samples-canary-promoted")
    schema = schema_of(store)
    produce(kafka.bootstrap, topic, records(schema, 64, per_request=16))
    with _trainer(store, topic, kafka) as trainer:
        canary = trainer.full.canary if trainer.full is not None else None
        assert canary is not None
        # the record is written before the trainer counts it: the wait takes both
        exp = wait_until(lambda: _count(trainer, "canaried") == 1 and _canary(store, "2"), 120,
                         "version 2 started as a canary and counted")  # fmt: skip
        control, candidate = exp.arm(ex.CONTROL), exp.arm("A")
        assert (candidate.version, candidate.share, control.version, control.share) == ("2", 0.1, "1", 0.9)
        assert exp.unit_key == "" and ms.current(store, NAME) == "1"
        assert ms.version_dir(store, NAME, "2").is_dir() and not ms.list_deltas(
            ms.version_dir(store, NAME, "2")
        )
        # while it runs: deltas go on into control, and the next full version waits
        before = len(ms.list_deltas(ms.version_dir(store, NAME, "1")))
        produce(kafka.bootstrap, topic, records(schema, 64, per_request=16, prefix="s", skip=64))
        wait_until(lambda: canary.waits, 120, "a full version put off while the canary runs")
        assert len(ms.list_deltas(ms.version_dir(store, NAME, "1"))) > before
        assert ms.versions(store, NAME) == ["1", "2"] and ms.current(store, NAME) == "1"
        assert not ms.list_deltas(ms.version_dir(store, NAME, "2"))  # a frozen snapshot

        ex.promote(store, NAME, "A", by="rule", evidence={"statistic": 9.9})
        assert ms.current(store, NAME) == "2"
        wait_until(lambda: trainer.result.version == "2", 60, "the trainer following version 2")
        produce(kafka.bootstrap, topic, records(schema, 64, per_request=16, prefix="t", skip=128))
        wait_until(lambda: ms.list_deltas(ms.version_dir(store, NAME, "2")), 120, "a delta into version 2")
        wait_until(lambda: _count(trainer, "canary_promoted") == 1, 120, "the promotion counted")
        assert canary.promoted == ["2"] and not canary.dropped and trainer.result.reloads == 1
        assert _count(trainer, "published") == 0  # the rule published it, not the trainer


def test_an_aborted_canary_is_dropped_and_the_next_one_is_canaried(kafka, new_topic, store):
    topic = new_topic("samples-canary-aborted")
    schema = schema_of(store)
    produce(kafka.bootstrap, topic, records(schema, 64, per_request=16))
    with _trainer(store, topic, kafka) as trainer:
        canary = trainer.full.canary if trainer.full is not None else None
        assert canary is not None
        wait_until(lambda: _canary(store, "2"), 120, "version 2 started as a canary")
        ex.abort(store, NAME, "A", by="rule", evidence={"statistic": -9.9})
        produce(kafka.bootstrap, topic, records(schema, 64, per_request=16, prefix="s", skip=64))
        exp = wait_until(lambda: _count(trainer, "canaried") == 2 and _canary(store, "3"), 120,
                         "version 3 started as the next canary and counted")  # fmt: skip
        assert exp.arm("A").version == "3" and exp.arm(ex.CONTROL).version == "1"
        assert _count(trainer, "canary_dropped") == 1
        assert canary.dropped == ["2"] and canary.started == ["2", "3"] and not canary.promoted
        # serving never left control: CURRENT never moved, the trainer never reloaded
        assert ms.current(store, NAME) == "1" and ms.history(store, NAME) == ["1"]
        assert trainer.result.version == "1" and trainer.result.reloads == 0
    aborted = [e for e in ex.read_log(store, NAME) if e.event == ex.ABORTED]
    assert [(e.record.name, e.by) for e in aborted] == [(name_of("2"), "rule")]
    (decision,) = aborted[0].record.decisions
    assert (decision.version, decision.decision, decision.evidence) == ("2", ex.ABORTED, {"statistic": -9.9})


def test_a_canary_the_store_refuses_is_counted_and_not_published(store, tmp_path):
    """An operator's experiment started between the trainer's look and its start (the store refuses
    a second one): the version is refused, logged and counted, and neither served nor published."""
    cfg = stream_cfg(
        store, "kafka://127.0.0.1:1/none", full_every="2d", canary_share=0.1, metrics_port=free_port()
    )
    ex.start(store, NAME, "operator-aa", [("1", 0.5)])
    with FollowTrainer(cfg) as trainer:
        full = trainer.full
        assert full is not None and full.canary is not None
        assert full.canary.busy()  # what keeps the next full version waiting
        assert not full.publish("1")
        full.settle()
        assert full.refused == ["1"] and _count(trainer, "refused") == 1 and not full.canary.started
    exp = ex.read_experiment(store, NAME)
    assert exp is not None and exp.running and exp.name == "operator-aa" and ms.current(store, NAME) == "1"
