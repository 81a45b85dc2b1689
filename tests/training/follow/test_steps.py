"""A consume's steps on keyed samples (training/follow/steps.py, ``KeyedSteps``), without Kafka: the
held chunks of every partition step together once they reach the batch size, re-emitted samples are
dropped (within one step too), the rest is scored before it trains, and only then does the ledger
move past the chunks, to where each partition resumes (refused records included)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from features.schema import load_schema
from stream.sample_batch import read_samples
from tests.helpers import ROOT
from tests.training.sources.samples import key, records
from training.follow.book import StreamBook
from training.follow.steps import KeyedSteps
from training.sources import Keyed, KeyedChunk, Look, Position
from training.sources.ledger import Ledger

SCHEMA = load_schema(ROOT / "data/schemas/criteo.yaml")
RECS = records(SCHEMA, 60, per_request=20)
"""(request id, item, label, sample record) of 60 rows of the Criteo sample."""


def chunk(recs, unit: str = "samples/0", start: int = 0, refused: int = 0) -> KeyedChunk:
    """``recs`` as one consume's chunk of ``unit`` at offset ``start``, ``refused`` malformed
    records among them (the partition resumes after all of them)."""
    samples, bad = read_samples([r[3] for r in recs])
    assert not bad
    return KeyedChunk(Keyed(samples, SCHEMA), Position(unit, start), start + len(recs) + refused, refused)


class Ctx:
    """A TrainCtx's two calls: logits that rank every sample right (its label, shifted by one
    trained weight), the loss backpropagated; what each step saw is kept."""

    def __init__(self, fail: bool = False):
        self.weight = torch.zeros(1, requires_grad=True)
        self.fail = fail
        self.batches: list = []
        self.losses: list[float] = []
        self.told: list[list] = []  # the batches each step was told come next (``upcoming``)

    def forward(self, batch) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("the PS went away")
        self.batches.append(batch)
        return torch.from_numpy(batch.labels) * 4 - 2 + self.weight

    def backward(self, loss: torch.Tensor) -> None:
        self.losses.append(float(loss.detach()))
        loss.backward()

    def upcoming(self, after) -> None:
        self.told.append(list(after))


@pytest.fixture
def steps(tmp_path) -> KeyedSteps:
    book = StreamBook("kafka://b/samples", keyed=True, window_s=3600.0)
    return KeyedSteps(book, Ledger(tmp_path / "ledger.json"), batch_rows=40)


def _keys(recs) -> list[tuple[str, int]]:
    return sorted((r[0], r[1]) for r in recs)


def test_a_step_is_due_once_the_held_chunks_of_any_partitions_reach_the_batch_rows(steps):
    assert not steps.hold(chunk(RECS[:20], "samples/0"))
    assert not steps.hold(chunk(RECS[20:39], "samples/1"))
    assert steps.hold(chunk(RECS[39:40], "samples/0", start=20))  # 40 rows held, two partitions


def test_nothing_held_is_no_step(steps):
    ctx = Ctx()
    assert steps.step(ctx) is None
    assert ctx.batches == [] and steps.ledger.positions() == {} and steps.book.total.rows == 0


def test_one_step_trains_every_held_chunk_scored_first_and_then_moves_the_ledger(steps):
    labels = np.array([r[2] for r in RECS[:40]])
    assert 0 < labels.sum() < len(labels)  # both classes: the AUC is defined
    steps.ledger.resume({"samples/1": 100})  # partition 1 resumes at offset 100
    steps.hold(chunk(RECS[:20], "samples/0", start=0, refused=2))
    steps.hold(chunk(RECS[20:40], "samples/1", start=100))
    ctx = Ctx()

    assert steps.step(ctx) == 40 and steps.held == []
    (batch,) = ctx.batches  # one step for both partitions' chunks
    assert batch.num_rows == 40 and sorted(batch.labels.tolist()) == sorted(labels.tolist())
    assert len(ctx.losses) == 1 and ctx.weight.grad is not None  # the step trained
    # every sample scored before it trained: the logits rank them all right
    total = steps.book.progressive.total()
    assert (total.samples, total.auc) == (40, 1.0)
    assert (steps.book.total.rows, steps.book.total.refused, steps.book.total.duplicates) == (40, 2, 0)
    assert sorted(map(key, steps.book.keys.arrays()[0])) == _keys(RECS[:40])
    # each partition resumes after its chunk, past the refused records too; nothing committed yet
    assert steps.ledger.positions() == {"samples/0": 22, "samples/1": 120}
    assert not steps.ledger.path.exists()


def test_re_emitted_samples_are_dropped_and_the_ledger_still_moves_past_them(steps):
    ctx = Ctx()
    steps.hold(chunk(RECS[:20]))
    assert steps.step(ctx) == 20
    # the joiner restarts and emits them again: nothing to train, but their offsets are read
    steps.hold(chunk(RECS[:20], start=20))
    assert steps.step(ctx) is None and len(ctx.batches) == 1
    assert steps.book.total.duplicates == 20 and steps.ledger.row("samples/0") == 40
    # half again, half new: only the new half trains
    steps.hold(chunk(RECS[10:30], start=40))
    assert steps.step(ctx) == 10
    assert ctx.batches[-1].num_rows == 10 and steps.book.total.duplicates == 30
    assert sorted(map(key, steps.book.keys.arrays()[0])) == _keys(RECS[:30])
    assert steps.book.total.rows == 30 and steps.ledger.row("samples/0") == 60


def test_a_sample_in_two_chunks_of_one_step_trains_once(steps):
    steps.hold(chunk(RECS[:20], "samples/0"))
    steps.hold(chunk(RECS[10:20], "samples/1"))  # re-emitted into another partition
    assert steps.step(Ctx()) == 20
    assert steps.book.total.duplicates == 10 and len(steps.book.keys) == 20


def test_a_step_that_fails_leaves_the_ledger_where_it_was(steps):
    """The ledger never claims a record that no step took: a failed step does not move it (a
    restart reads the records again)."""
    steps.hold(chunk(RECS[:20], start=5))
    with pytest.raises(RuntimeError, match="the PS went away"):
        steps.step(Ctx(fail=True))
    assert steps.ledger.row("samples/0") == 0 and steps.book.total.rows == 0 and len(steps.book.keys) == 0


def _look(parts: list[KeyedChunk], after=()) -> list[KeyedChunk]:
    """``parts`` as the chunks of one look, its samples and batch built with it (as the Kafka
    source's reading thread builds them)."""
    whole = Keyed.join([c.keyed for c in parts])
    look = Look(whole, len(parts), whole.batch(), tuple(after))
    return [KeyedChunk(c.keyed, c.start, c.end, c.refused, look) for c in parts]


def test_a_whole_look_steps_on_its_own_batch_and_tells_the_ctx_the_looks_read_after_it(steps):
    next_batch = Keyed(read_samples([r[3] for r in RECS[40:60]])[0], SCHEMA).batch()
    chunks = _look(
        [chunk(RECS[:20], "samples/0"), chunk(RECS[20:40], "samples/1", start=7)], after=[next_batch]
    )
    for c in chunks:
        steps.hold(c)
    ctx = Ctx()
    assert steps.step(ctx) == 40
    assert ctx.batches == [chunks[0].look.batch] and ctx.told == [[next_batch]]  # the same objects
    assert steps.ledger.positions() == {"samples/0": 20, "samples/1": 27}


def test_a_look_not_taken_whole_is_batched_anew(steps):
    chunks = _look([chunk(RECS[:20], "samples/0"), chunk(RECS[20:40], "samples/1")])
    steps.book.keys.add(chunks[0].keyed.keys[:5], np.full(5, 1.7e9))
    for c in chunks:
        steps.hold(c)
    ctx = Ctx()
    assert steps.step(ctx) == 35  # five trained already: the look's own batch would train them again
    (batch,) = ctx.batches
    assert batch is not chunks[0].look.batch and batch.num_rows == 35
    steps.hold(_look([chunk(RECS[40:60], "samples/0", start=20)])[0])
    steps.hold(chunk(RECS[40:41], "samples/1", start=20))  # another look's chunk beside it
    assert steps.step(ctx) == 20 and ctx.batches[-1] is not None and ctx.batches[-1].num_rows == 20


def test_each_sample_weighs_the_same_whatever_the_size_of_its_step(steps):
    """The join sends clicks as they come and a request's negatives together at its window's close:
    a stream's steps differ in size and in labels. Cut anyhow, the steps' losses sum to the loss of
    one step over them all: a mean per step weighed a small step's clicks tens of times more than a
    large step's negatives (bench-delayed's served model climbed to 4.5x the click rate)."""
    rng = np.random.default_rng(0)
    logits, labels = (
        torch.from_numpy(rng.normal(-3, 1, 100)),
        torch.from_numpy((rng.random(100) < 0.05) * 1.0),
    )
    weights = rng.uniform(0.5, 2, 100)
    whole = steps.loss(logits, labels, weights)
    for cut in (3, 37, 99):
        parts = steps.loss(logits[:cut], labels[:cut], weights[:cut]) + steps.loss(
            logits[cut:], labels[cut:], weights[cut:]
        )
        assert float(parts) == pytest.approx(float(whole), rel=1e-12)
    full = torch.nn.functional.binary_cross_entropy_with_logits(logits[:40], labels[:40])
    assert float(steps.loss(logits[:40], labels[:40])) == pytest.approx(
        float(full), rel=1e-12
    )  # a full step: the mean
