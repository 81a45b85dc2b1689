"""The streaming trainer's steps on keyed samples (``recserve train --follow --stream``).

A stream source yields one chunk per partition of each consume; the trainer steps on the chunks of
one consume together (``Reading.batch_rows`` records at most: a full step whatever the number of
partitions, where one step per chunk trained a few rows each), and earlier when the held rows
reach the batch size. Each step drops the samples whose key was trained already, scores the rest
before it trains on them (progressive validation), and only then moves the ledger past the chunks:
the ledger never claims a record that no step took.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.nn import functional

from features.batch import CompactBatch
from stream.sample_batch import request_ids
from training.ctx import TrainCtx
from training.evaluate import sigmoid
from training.follow.book import StreamBook
from training.follow.delayed import DelayedFeedback
from training.sources import Keyed, KeyedChunk, Look
from training.sources.ledger import Ledger


@dataclass
class KeyedSteps:
    book: StreamBook
    ledger: Ledger
    batch_rows: int
    """Step once the held chunks have this many rows."""
    held: list[KeyedChunk] = field(default_factory=list)
    _held_rows: int = field(default=0, init=False)  # rows of ``held``, kept as chunks come
    judge: Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], bool] | None = None
    delayed: DelayedFeedback = field(default_factory=lambda: DelayedFeedback("none"))
    """How the loss weighs labels that may be corrected later (``--delayed-feedback``)."""
    """The output guard (``training.follow.revert.Rewinder.judge``): fed each step's served scores,
    labels, request ids and the deltas that served them before it trains; False: the step is read,
    not trained (the guard holds)."""

    def hold(self, chunk: KeyedChunk) -> bool:
        """Hold a keyed chunk for the next step; True when a step is due."""
        self.held.append(chunk)
        self._held_rows += chunk.rows
        return self._held_rows >= self.batch_rows

    def step(
        self, ctx: TrainCtx, forward: Callable[[CompactBatch], torch.Tensor] | None = None
    ) -> int | None:
        """One step on the held chunks' samples not trained yet (``forward``: the step's logits,
        default ``ctx.forward``); the rows trained (None: no step: nothing held, or every sample
        held was trained already or refused)."""
        chunks, self.held, self._held_rows = self.held, [], 0
        if not chunks:
            return None
        look = _whole_look(chunks)  # its samples and batch as the reading thread built them
        keyed = look.keyed if look is not None else Keyed.join([c.keyed for c in chunks])
        rows = self.book.admit(keyed, sum(c.refused for c in chunks))
        trained = None
        if keyed.samples.num_rows and (rows is None or len(rows)):
            batch = (
                look.batch
                if look is not None and look.batch is not None and rows is None
                else keyed.batch(rows)
            )
            assert batch.labels is not None
            served = keyed.samples.scores if rows is None else keyed.samples.scores[rows]
            keys = keyed.keys if rows is None else keyed.keys[rows]
            deltas = keyed.samples.deltas if rows is None else keyed.samples.deltas[rows]
            if self.judge is not None and not self.judge(served, batch.labels, request_ids(keys), deltas):
                self._advance(chunks)
                return None
            ctx.upcoming(chunks[-1].look.after if chunks[-1].look is not None else ())
            logits = (forward or ctx.forward)(batch)
            scores = sigmoid(logits.detach().cpu().numpy())
            elapsed = keyed.samples.elapsed if rows is None else keyed.samples.elapsed[rows]
            weights = self.delayed.weights(scores, batch.labels, elapsed)
            ctx.backward(self.loss(logits, torch.from_numpy(batch.labels), weights))
            self.book.trained(keyed, rows, batch.labels, scores)
            trained = batch.num_rows
        self._advance(chunks)
        return trained

    def loss(
        self, logits: torch.Tensor, labels: torch.Tensor, weights: np.ndarray | None = None
    ) -> torch.Tensor:
        """The step's log loss, each sample weighed 1 / ``batch_rows`` whatever the step's size: a
        stream's steps are as large as what came (a look's, a consume's), and their labels are not
        alike: the join sends a click when it comes and its request's negatives together when the
        window closes. A mean over each step weighed the clicks of a small step tens of times more
        than the negatives of a large one: bench-delayed's steps held 209 samples on average, and
        the served model climbed from 2x to 4.5x the click rate in 3 minutes of a world of 3%
        (drop-late, 1.4% of samples positive); in one step of ``batch_rows`` it is the mean."""
        w = None if weights is None else torch.from_numpy(weights)
        per = functional.binary_cross_entropy_with_logits(logits, labels, w, reduction="sum")
        return per / self.batch_rows

    def _advance(self, chunks: list[KeyedChunk]) -> None:
        for c in chunks:
            self.ledger.advance(c.start.unit, c.stop.row - self.ledger.row(c.start.unit))


def _whole_look(chunks: list[KeyedChunk]) -> Look | None:
    """The look ``chunks`` are, all of it and nothing else (None: not one whole look)."""
    look = chunks[0].look
    return (
        look
        if look is not None and len(chunks) == look.chunks and all(c.look is look for c in chunks)
        else None
    )
