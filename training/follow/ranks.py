"""Several ranks following one stream: ``torchrun --nproc-per-node N -m recserve train --follow
MODEL_DIR --stream kafka://BROKERS/TOPIC``.

Each rank reads its share of the source's parts, the topic's partitions, assigned by number
(``training.sources.share``: partition % world == rank) and trains through the same hybrid step as ``recserve train``: its own
worker over PS processes that hold the followed version's rows (``training.follow.tables.shared``:
rank 0 starts one per shard of the version, on its node's address when the job spans nodes, loads
the version's dump and every delta already cut into it, and tells the other ranks where they are),
so every rank's sparse updates reach the same rows. One process stays the embedded default
(in-process tables).

The ranks move in rounds, one per look (each rank's consume): at its look every rank says whether
it is done (``--once``: its partitions read to their end) or stopped (SIGTERM, ``--max-seconds``),
and rank 0 whether a delta is due (its clock) and whether CURRENT names a new version
(``training.follow.current``); then all cut, move, go on or end together (``Ranks.look``).
A cut is one delta with one writer: every rank steps on what it holds and flushes its updates to
the shards, then sends rank 0 what it trained since the last cut (``Share``: its partitions'
offsets, the keys trained with their times, the window's labels and scores, its counts); rank 0
has the shards dump the delta and writes its record with every rank's offsets and keys; then every
rank commits its ledger. A move is a cut into the old version, then every rank drops it (rank 0
stops its shards) and loads the new one (rank 0 starts new shards), and resumes where the new
version's record says, else where it stands, cut at once as the new version's first delta.

A rank that dies fails the others at their next collective; torchrun (``--max-restarts``) starts
every rank again, and each resumes from the last published delta's record (the shards of a rank 0
that was SIGKILLed die with it: they are started again and loaded with the version and its deltas).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from training import ranks
from training.follow.cut import DeltaCut
from training.follow.types import Share
from training.sources import TICK, Chunk, Part, share

if TYPE_CHECKING:
    from training.cluster import Cluster
    from training.follow.book import StreamBook
    from training.sources.ledger import Ledger

log = logging.getLogger("recserve.train.follow")
T = TypeVar("T")


@dataclass(frozen=True)
class Round:
    """What every rank does after a look."""

    cut: bool
    """Cut a delta: rank 0's clock says one is due."""
    end: bool
    """End: every rank is done, or one stopped."""
    version: str | None = None
    """Move to this version: rank 0 saw CURRENT name it (the last delta into the old one first)."""


@dataclass
class Ranks:
    rank: int = 0
    world: int = 1
    done: bool = False
    """This rank's source ended (``--once``): it takes part in the rounds until every rank ends."""
    seq: int = -1
    """The last delta the job's shards hold."""
    units: frozenset[str] = frozenset()
    """The units of this rank's parts of the source (``take``)."""

    @classmethod
    def join(cls) -> Ranks:
        """This process's rank under torchrun (WORLD_SIZE > 1: the process group joined, gloo),
        else rank 0 of 1."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return cls()
        rank, world = ranks.join(torch.device("cpu"))
        return cls(rank, world)

    def rounds(self, chunks: Iterator[Chunk]) -> Iterator[Chunk]:
        """The source's chunks; with several ranks, after the source ends, a ``TICK`` per round
        until the ranks end together."""
        yield from chunks
        self.done = True
        while self.world > 1:
            yield TICK

    def take(self, parts: list[Part]) -> None:
        """This rank's share of the source's parts (``training.sources.share``, as the source
        assigns them): the units whose positions it sends rank 0 at a cut."""
        self.units = frozenset(p.unit for p in share(parts, self.rank, self.world))

    def look(self, cut_due: bool, stopped: bool, version: str | None = None) -> Round:
        """Every rank's round at a look, decided by every rank's votes (``version``: rank 0's)."""
        votes = ranks.all_ranks((cut_due, self.done, stopped, version), self.world)
        return Round(votes[0][0], all(v[1] for v in votes) or any(v[2] for v in votes), votes[0][3])

    def gather(self, share: Share) -> list[Share]:
        """Every rank's share on rank 0 (the others get [])."""
        got: list = [None] * self.world if self.rank == 0 else []
        dist.gather_object(share, got if self.rank == 0 else None, dst=0)
        return got

    def broadcast(self, obj: T) -> T:
        """Rank 0's ``obj`` on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def take_share(book: StreamBook, positions: dict[str, int], changed: bool, rank: int) -> Share:
    """This rank's share since the last cut; rank 0's book is the job's (its own share is in it
    already), another rank's window and counts go to rank 0's, and are marked cut here."""
    counts, keys, ts = book.since_cut()
    if rank == 0:
        empty = np.zeros(0, np.float32)
        return Share(positions, keys[:0], ts[:0], empty, empty, 0, 0, 0, changed)
    labels, scores = book.progressive.take_window()
    book.mark_cut()
    return Share(positions, keys, ts, labels, scores, counts.rows, counts.duplicates, counts.refused, changed,
                 book.final.take())  # fmt: skip


def merge_shares(book: StreamBook, shares: list[Share]) -> dict[str, int]:
    """Rank 0: the other ranks' shares into ``book`` (the job's), before it writes the delta's
    record; every rank's positions."""
    positions: dict[str, int] = {}
    for s in shares:
        positions |= s.positions
        book.add_keys(s.keys, s.ts)
        book.progressive.add(s.labels, s.scores)
        book.total.rows += s.rows
        book.total.duplicates += s.duplicates
        book.total.refused += s.refused
        if s.final is not None:
            book.final.merge(s.final)
    return positions


def cut_together(job: Ranks, cluster: Cluster, vdir: Path, book: StreamBook, ledger: Ledger,
                 changed: bool) -> int | None:  # fmt: skip
    """Every rank's part of one cut (each has flushed its updates to the shards): rank 0 writes the
    delta when some rank trained rows or read on (``StreamBook.moved``), with every rank's offsets
    and keys; every rank commits its ledger once it is published. Returns its seq (None: nothing
    changed)."""
    mine = {unit: at for unit, at in ledger.positions().items() if unit in job.units}  # resumed: every rank's
    shares = job.gather(take_share(book, mine, changed, job.rank))
    outcome: tuple[int | None, str] = (None, "")
    if job.rank == 0:
        try:
            positions = merge_shares(book, shares)
            if not DeltaCut.empty(any(s.changed for s in shares), book.moved(positions)):
                seq = job.seq + 1  # steps 2-5 of the one cut; every rank flushed (1), commits (7)
                DeltaCut.write(vdir, seq, lambda d: cluster.dump(d, delta=True),  # every rank's rows
                               record=lambda d: book.write(d, positions))  # fmt: skip
                outcome = (seq, "")
        except Exception as e:  # the other ranks wait for the outcome: tell them, then fail
            outcome = (None, f"{type(e).__name__}: {e}")
    published, error = job.broadcast(outcome)
    if error:
        raise RuntimeError(f"rank 0 could not cut the delta: {error}")
    ledger.commit()
    if published is not None:
        job.seq = published
        log.info("delta %d cut by rank 0 (rank %d's offsets %s)", published, job.rank, ledger.positions())
    return published
