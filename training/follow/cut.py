"""Cutting deltas into a model-store version: ``DeltaCut``, the one sequence every delta writer
follows (the streaming trainer, rank 0 of a streaming job, ``DeltaWriter``), and ``DeltaWriter``,
which writes deltas from outside a training run.

``DeltaWriter`` loads a version's embedding shards into in-process stores (one per shard, routed
like the PS), lets the caller change rows (``assign``) and cuts each change set as the next
``deltas/<seq>/`` of that version: every shard's delta, then the delta's ``_SUCCESS``. It starts
from what serving holds: the full dump plus the version's existing deltas, in order. The serving
PS shards following the model apply it within their poll interval. Used by the hot-swap
benchmarks and the tests; continuous training (``recserve train --follow``) cuts through the same
``DeltaCut``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

import model_store as ms
from features.hashing import shard_of
from serving.notices import Announcer, announce

if TYPE_CHECKING:
    from training.follow.book import StreamBook
    from training.follow.types import Loaded
    from training.sources.ledger import Ledger

log = logging.getLogger("recserve.train.follow")

Step = Callable[[Path], object]
"""A step of a cut that writes into the delta's directory."""


class DeltaCut:
    """One delta into a served version (``vdir``), as numbered steps:

    0. ``due``: ``interval_s`` passed since the last cut began (``begin``); ``empty``: no row
       changed and the stream did not move, so there is nothing to publish.
    1. flush: every sparse update applied to the shards (the caller's ``flush``).
    2. dump: every shard's rows changed since the last delta into ``deltas/<seq>/`` (``dump``),
       after refusing a ``<seq>`` another writer finished (one delta writer per version; a
       directory without ``_SUCCESS`` was never loaded by anyone, and the dump replaces it).
    3. encode: the rows in the version's serving dtype (``model_store.shards.encode_delta``).
    4. record: the delta's ``DELTA.json``, its offsets and trained keys (``record``; a writer
       without a stream has none).
    5. done: the delta's ``_SUCCESS``: followers load it from now on.
    6. announce: on the notice transport (``serving.notices``), at once where followers listen.
    7. commit: the ledger of what was trained (``commit``), only once the delta is published.

    ``commit`` runs them all in one process; a job of ranks runs 1 and 7 on every rank and 2-6 on
    rank 0 (``write``, ``announce``; ``training.follow.ranks.cut_together``). The streaming trainer
    takes the rows and the record in memory on its thread and runs 2-6 on the cut's own thread
    (``take``, ``start``) while it trains on; 7 once they are done (``settle``).
    """

    _pool: ThreadPoolExecutor | None = None
    pending: Pending | None = None
    """The delta written on the cut's own thread (``take``), until ``settle``."""

    def __init__(self, interval_s: float = 0.0, announcer: Announcer | None = None,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.interval_s = interval_s
        self.announcer = announcer
        self.clock = clock
        self.last = clock()

    def due(self) -> bool:
        return self.clock() - self.last >= self.interval_s

    @staticmethod
    def empty(changed: bool, moved: bool) -> bool:
        return not changed and not moved

    def begin(self) -> None:
        """A cut starts: the next is due ``interval_s`` from now."""
        self.last = self.clock()

    @staticmethod
    def write(vdir: Path, seq: int, dump: Step, record: Step | None = None) -> Path:
        """Steps 2-5: delta ``seq`` of ``vdir`` dumped, encoded, recorded and done; its directory."""
        ddir = ms.delta_dir(vdir, seq)
        if (ddir / ms.SUCCESS).exists():
            raise ms.ModelStoreError(f"{ddir} was written by someone else: one delta writer per version")
        dump(ddir)
        ms.shards.encode_delta(ddir, vdir)  # in the version's serving dtype
        if record is not None:
            record(ddir)
        ms.mark_done(ddir)
        return ddir

    def announce(self, vdir: Path, seq: int) -> float:
        """Step 6: tell serving of delta ``seq``; returns the time its ``_SUCCESS`` was written."""
        written = (ms.delta_dir(vdir, seq) / ms.SUCCESS).stat().st_mtime
        announce(self.announcer, vdir.parent, vdir.name, seq, written)
        return written

    def commit(self, vdir: Path, seq: int, dump: Step, *, flush: Callable[[], None] | None = None,
               record: Step | None = None, commit: Callable[[], None] | None = None) -> Path:  # fmt: skip
        """Steps 1-7 in one process; the delta's directory."""
        self.begin()
        if flush is not None:
            flush()
        ddir = self.write(vdir, seq, dump, record)
        self.announce(vdir, seq)
        if commit is not None:
            commit()
        return ddir

    def start(self, vdir: Path, seq: int, dump: Step, record: Step | None = None) -> Future[float]:
        """Steps 2-6 on the cut's own thread: ``dump`` and ``record`` write what was taken in
        memory (they read nothing training changes). The future's value: ``time.perf_counter()``
        once the delta was announced. The caller waits for one before it starts the next."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="recserve-delta-cut")
        return self._pool.submit(self._publish, vdir, seq, dump, record)

    def take(self, lv: Loaded, seq: int, book: StreamBook, ledger: Ledger, began: float) -> Pending:
        """A streaming trainer's cut of delta ``seq`` of ``lv``: 1 here, the rows
        (``Cluster.cut_deltas``) and the record (``StreamBook.take``) taken in memory, 2-6 started
        on the cut's own thread; with gRPC shards (which cut at their dump) the caller waits for
        it before it trains on (``Pending.threaded``)."""
        self.begin()
        lv.ctx.flush()  # every sparse update applied
        deltas = lv.cluster.cut_deltas()
        ddir = ms.delta_dir(lv.vdir, seq)
        record = book.take(ddir, ledger.positions())
        dump: Step = (
            (lambda d: lv.cluster.dump(d, delta=True))
            if deltas is None
            else (lambda d: lv.cluster.write_deltas(d, deltas))
        )
        published = self.start(lv.vdir, seq, dump, lambda d: record())
        self.pending = Pending(lv.version, seq, ddir, published, ledger.take(), began, deltas is not None)
        return self.pending

    def published(self) -> bool:
        """The delta in flight is written and announced (or failed): ``settle`` will not wait."""
        return self.pending is not None and self.pending.future.done()

    def settle(self, ledger: Ledger, book: StreamBook) -> None:
        """Step 7 of the delta in flight (none: nothing to do): wait until it is published (what
        its thread raised, raised here), then commit the ledger's progress it holds."""
        p, self.pending = self.pending, None
        if p is None:
            return
        done = p.future.result()
        ledger.commit(p.taken)
        book.published(done - p.began)
        log.info("delta %s/%d published %.0f ms after its cut began: %s", p.version, p.seq,
                 (done - p.began) * 1e3, p.ddir)  # fmt: skip

    def _publish(self, vdir: Path, seq: int, dump: Step, record: Step | None) -> float:
        self.write(vdir, seq, dump, record)
        self.announce(vdir, seq)
        return time.perf_counter()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


@dataclass
class Pending:
    """A delta whose files are written on the cut's own thread (``DeltaCut.start``): once it is
    published, the ledger commits the progress it holds (``Ledger.take``)."""

    version: str
    seq: int
    ddir: Path
    future: Future[float]
    taken: dict[str, dict]
    began: float
    """``time.perf_counter()`` when the cut began."""
    threaded: bool = True
    """False: the rows are cut as they are written (gRPC shards): training waits for it."""


class DeltaWriter:
    def __init__(self, root, model: str, version: str | None = None):
        from serving.ps.shard import TableShard, TableShardConfig
        from serving.ps.spec import TableSpec

        version = version or ms.current(root, model)
        if version is None:
            raise ms.ModelStoreError(f"{model}: nothing published")
        self.version: str = version
        self.vdir = ms.version_dir(root, model, self.version)
        manifest = ms.read_manifest(self.vdir, verify=False)
        self.num_shards, self.dim = manifest.num_shards, manifest.dim
        self.stores = []
        for i in range(self.num_shards):
            store = TableShard(
                TableShardConfig(
                    table=TableSpec(dim=self.dim, capacity=4_000_000), shard=i, num_shards=self.num_shards
                )
            )
            store.load(self.vdir / "embeddings")
            store.version = self.version  # deltas name the version they belong to
            store.delta_seq = max(
                [store.delta_seq, *ms.list_deltas(self.vdir)]
            )  # continue after existing deltas
            self.stores.append(store)

    def signs(self) -> np.ndarray:
        """Every sign the version has a row for."""
        return np.concatenate([s.snapshot(copy=False).signs for s in self.stores])

    def lookup(self, signs) -> np.ndarray:
        signs = np.asarray(signs, np.uint64)
        out = np.zeros((len(signs), self.dim), np.float32)
        owner = shard_of(signs, self.num_shards)
        for i, store in enumerate(self.stores):
            mask = owner == i
            out[mask] = store.lookup(signs[mask])[0]
        return out

    def assign(self, signs, rows) -> None:
        signs = np.asarray(signs, np.uint64)
        rows = np.asarray(rows, np.float32)
        owner = shard_of(signs, self.num_shards)
        for i, store in enumerate(self.stores):
            mask = owner == i
            if mask.any():
                store.assign(signs[mask], rows[mask])

    def publish(
        self, announcer: Announcer | None = None, record: Step | None = None
    ) -> tuple[int, Path, float]:
        """Cut the changes so far as the next delta, mark it done and announce it (``DeltaCut``;
        ``record``: step 4, before its ``_SUCCESS``); returns (seq, its directory, the time its
        ``_SUCCESS`` was written)."""
        seq = self.stores[0].delta_seq + 1
        ddir = DeltaCut(announcer=announcer).commit(self.vdir, seq, self._dump, record=record)
        return seq, ddir, (ddir / ms.SUCCESS).stat().st_mtime

    def _dump(self, ddir: Path) -> None:
        for store in self.stores:
            store.dump_delta(ddir)
