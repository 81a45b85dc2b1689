"""Continuous training into the served version: ``recserve train --follow MODEL_DIR --watch DIR``
or ``--stream kafka://BROKERS/TOPIC``.

Reads top to bottom like train.py: resolve ``<model>/CURRENT`` -> load that version (its shards
with optimizer state plus every delta already cut into it, so training continues from exactly
what serving holds; its schema; its dense ``dense/model.pt``, FROZEN) -> loop: the rows of the
source (a registered data source, ``training.sources``) go through the same TrainCtx and worker
path as ``recserve train``, and every ``--delta-interval-s`` seconds the changed rows are cut as
the version's next ``deltas/<seq>/`` (every shard's delta, then ``_SUCCESS``, announced with
``--announce``), which serving applies at its notice or poll. Nothing assumes the source ends.

The dense model is frozen (rows trained against a moving network would drift from the served
one); it ships in full versions (``--full-every``: ``full_version``; ``--canary-share``: ``canary``).

Embeddings live in in-process ``TableShard``s (one per shard, routed by the PS's hash) behind an
in-process worker, or under torchrun in PS processes every rank trains through
(``training.follow.tables``, ``.ranks``). A delta is a dump of them; one delta writer per version.

The ledger of the rows trained from each unit (a file, a partition: ``training/sources/ledger.py``)
is committed only after a delta's ``_SUCCESS``, so it never claims rows no published delta holds:
after a crash a file's rows since the last delta are trained again; after SIGTERM, Ctrl-C or
``--max-seconds`` a final delta is cut; an unreadable file is recorded as failed and skipped.

``--stream kafka://...`` is exactly once in what is trained (``training.follow.steps``): each delta
records the partitions' next offsets and the (request, item, kind) keys trained over
``--dedup-window-s`` before its ``_SUCCESS``; a restart resumes there and drops a sample whose key
was trained. Each batch is scored before it trains (progressive validation), the output guard
judges its served scores (``training.follow.guard``), ``--delayed-feedback`` weighs its loss.

If CURRENT moves (``recserve publish``, a canary promoted), the pending rows are cut into the old
version and the trainer moves to the new one (every torchrun rank at the look where rank 0 saw it);
one the serving PS refuses is refused here too (``training.follow.current``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import torch

import model_store as ms
from features.transform import FeatureError, transform
from serving import memory, notices
from training import data, sources
from training.follow import tables as follow_tables
from training.follow.book import StreamBook
from training.follow.config import FollowConfig
from training.follow.current import REFUSALS, CurrentWatch
from training.follow.cut import DeltaCut
from training.follow.delayed import DelayedFeedback
from training.follow.full_version import FullVersions
from training.follow.guard import OutputGuard
from training.follow.ranks import Ranks, cut_together
from training.follow.revert import Rewinder
from training.follow.standby import FollowLock, stand_by
from training.follow.steps import KeyedSteps
from training.follow.types import FollowResult, Loaded
from training.sources import TICK, Chunk, KeyedChunk, Reading
from training.sources.ledger import Ledger, ledger_path

log = logging.getLogger("recserve.train.follow")


def follow(cfg: FollowConfig, stop: threading.Event | None = None) -> FollowResult:
    """Run until ``stop`` is set, ``cfg.max_seconds`` passed, or (``cfg.once``) the files present
    now are trained; a final delta is cut in every case but an exception."""
    torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 2) // 2))
    with FollowTrainer(cfg, job=Ranks.join()) as trainer:
        return trainer.run(stop or threading.Event())


# ---- the trainer -----------------------------------------------------------------------------------
class FollowTrainer:
    def __init__(self, cfg: FollowConfig, clock=time.monotonic, job: Ranks | None = None):
        self.cfg = cfg
        self.clock = clock
        self.job = job or Ranks()  # torchrun's ranks split a stream (training.follow.ranks)
        kind = sources.parse(*cfg.source)[0]  # keyed samples or tables: a property of the kind
        if self.job.world > 1 and not kind.keyed:
            raise ValueError("torchrun ranks split a stream's partitions (--stream); --watch is one process")
        if self.job.world > 1 and cfg.full_every:
            raise ValueError("--full-every: full versions are written by one process, not under torchrun")
        self.ledger = Ledger(ledger_path(cfg.ledger, self.job.rank, self.job.world))
        self.loaded: Loaded | None = None
        self.result = FollowResult()
        self._changed = False  # rows trained since the last delta
        self.current = CurrentWatch(cfg.store, cfg.model, cfg.poll_s, clock)  # the version to follow next
        self.book = StreamBook(cfg.source[0], kind.keyed, cfg.dedup_window_s)  # keys, scores, counts
        if cfg.metrics_port:
            self.book.serve_metrics(cfg.metrics_port + self.job.rank, cfg.metrics_host)  # a port per rank
        self.full = FullVersions(cfg, self.book, clock) if cfg.full_every else None
        delayed = DelayedFeedback(cfg.delayed_feedback)  # how the loss weighs labels corrected later
        self.keyed = KeyedSteps(self.book, self.ledger, cfg.batch_size, delayed=delayed)
        guarded = cfg.guard.enabled and kind.keyed and self.job.world == 1  # the output guard
        self.rewinder = (
            Rewinder(OutputGuard(cfg.guard), self.book.registry, Path(cfg.follow)) if guarded else None
        )
        self.keyed.judge = self.rewinder.judge if self.rewinder is not None else None
        self._first_rows: float | None = None  # when the first rows were read
        self.announcer = notices.announcer(cfg.announce)  # each delta's _SUCCESS, told to serving
        self.cutter = DeltaCut(cfg.delta_interval_s, self.announcer, clock)  # the one delta cut
        self.lock: FollowLock | None = None  # held while writing deltas (training/follow/standby.py)

    # ---- loop ------------------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> FollowResult:
        t0 = self.clock()
        deadline = t0 + self.cfg.max_seconds if self.cfg.max_seconds else float("inf")
        if self.job.world == 1:  # one writer of the model's deltas; another trainer stands by
            self.lock = self.lock or FollowLock(Path(self.cfg.follow))
            if not self.lock.take() and not stand_by(self, self.lock, stop):
                return self.result
        self._follow_current()
        lv = self.loaded
        assert lv is not None  # _follow_current loads one or raises
        reading = Reading(lv.schema, poll_s=self.cfg.poll_s, once=self.cfg.once, batch_rows=self.cfg.batch_size,
                          fill_s=min(self.cfg.poll_s, self.cfg.delta_interval_s / 4),
                          part=(self.job.rank, self.job.world),
                          wait=lambda s: stop.wait(max(0.0, min(s, deadline - self.clock()))))  # fmt: skip
        spec, default = self.cfg.source
        source = sources.open_source(spec, reading, default=default, ledger=self.ledger)
        if self.job.world > 1:
            self.job.take(source.list_parts())  # this rank's parts, by number
        for chunk in self.job.rounds(source.chunks()):
            stopped = stop.is_set() or self.clock() >= deadline
            if stopped and self.job.world == 1:
                break
            if chunk is TICK:
                self.step_keyed()  # the last look's samples, before the lag counts them trained
                self.book.lag(source.behind(), source.skipped())
                if self.job.world > 1:  # the ranks cut, move to a new CURRENT, go on or end together
                    turn = self.job.look(
                        self.cutter.due(), stopped, self.current.proposed(self.job.rank, self.loaded)
                    )
                    if turn.end:
                        break
                    if turn.version is not None:
                        self._move(turn.version)
                    elif turn.cut:
                        self.cut()
                    continue
                # CURRENT after the source looked: a file dropped once a version was published
                # trains into that version (a stream's looks, a step apart: once a --poll-s)
                if not self.book.keyed or self.current.due():
                    self._follow_current()
                self._maybe_cut()
            elif not self.train_chunk(chunk, stop, deadline):
                break
            self._maybe_full()
        self.cut()
        r = self.result
        r.seconds = self.clock() - t0
        r.train_seconds = 0.0 if self._first_rows is None else self.clock() - self._first_rows
        self.book.tally(r)  # with ranks, rank 0's book holds the job's counts, another rank's its own
        if self.full is not None:
            r.full_versions, r.refused_versions = self.full.published, self.full.refused
        return self.result

    def keep_up(self) -> int:
        """A standby's look: a new CURRENT loaded (nothing cut: the deltas are not ours to write),
        else the served version's new deltas applied. Returns the deltas applied."""
        before = self.loaded.version if self.loaded is not None else None
        self._follow_current(cut=False)
        lv = self.loaded
        assert lv is not None
        return 0 if lv.version != before else follow_tables.apply_deltas(lv.vdir, lv.cluster.stores)

    def take_over(self) -> None:
        """A standby with the lock: resume where the last delta (or a file source's ledger) says."""
        lv = self.loaded
        assert lv is not None
        self.ledger.reload()
        self.book.resume(lv.vdir, self.ledger)
        if self.full is not None:
            self.full.restart()
        self.cutter.begin()

    def _follow_current(self, cut: bool = True) -> None:
        """Load CURRENT's version at the start; later, move to a new CURRENT (``cut``: the last
        delta into the old one first; a standby writes none) unless it is refused: by the gate
        (``training.follow.current``), or as it cannot be loaded. Refused, it stays on the old one."""
        if self.loaded is None:
            self._follow(self._load(self.current.first()))
            memory.freeze_loaded()  # imports and the version, out of the collector's scans
            return
        version = self.current.moved(self.loaded)
        if version is None:
            return
        try:
            new = self._load(version)  # verifies every file
        except REFUSALS as e:
            self.current.refuse(version, self.loaded.version, e)
            return
        self._move(version, new, cut)

    def _move(self, version: str, new: Loaded | None = None, cut: bool = True) -> None:
        """From the version followed to ``version`` (``new``: loaded already; else once the old one
        is cut and gone: every rank at one look). A stream the new version holds no record of goes
        on where it stands, cut at once as its first delta: a restart resumes from that."""
        old = self.loaded
        assert old is not None
        log.info("CURRENT moved %s -> %s%s", old.version, version,
                 f": last delta into {old.version}, then following {version}" if cut else "")  # fmt: skip
        if cut:
            self.cut()
        self._unload()
        self._follow(new or self._load(version))
        self.result.reloads += 1
        if cut:
            self.cut()

    def _follow(self, lv: Loaded) -> None:
        """Train into ``lv`` from now on; a stream resumes where its record says (else goes on)."""
        self.loaded = lv
        self.book.resume(lv.vdir, self.ledger)
        self.result.version = lv.version

    def train_chunk(self, chunk: Chunk, stop: threading.Event, deadline: float) -> bool:
        """Train on the rows of ``chunk`` and count them in the ledger; False when stopped before
        its end. A chunk that cannot be trained on fails its unit in the ledger (the source skips
        the rest of it)."""
        lv, unit = self.loaded, chunk.start.unit
        if lv is None:
            raise RuntimeError("train_chunk called before a version was loaded")
        if self._first_rows is None and chunk.rows:
            self._first_rows = self.clock()
        if isinstance(chunk, KeyedChunk):
            self.train_keyed(chunk)
            return True
        if chunk.table.num_rows and unit not in self.result.files:
            log.info("training on %s from row %d into version %s", unit, chunk.start.row, lv.version)
        batches = (transform(t, lv.schema) for t in data.rebatch([chunk.table], self.cfg.batch_size))
        try:
            for batch in lv.ctx.steps(batches):
                if unit not in self.result.files:
                    self.result.files.append(unit)
                if stop.is_set() or self.clock() >= deadline:
                    return False
                if batch.labels is None:
                    raise FeatureError("no label column: nothing to train on")
                logits = self._forward(lv, batch)
                lv.ctx.backward(self.keyed.loss(logits, torch.from_numpy(batch.labels)))
                self.ledger.advance(unit, batch.num_rows)
                self.book.rows(batch.num_rows)
                self.result.rows += batch.num_rows
                self.result.steps += 1
                self._changed = True
                self._maybe_cut()
        except FeatureError as e:
            log.error("%s: skipping the rest of it: %s", unit, e)
            self.ledger.fail(unit, str(e))
            return True
        self.ledger.finish(chunk)
        return True

    def train_keyed(self, chunk: KeyedChunk) -> None:
        """Hold a stream's chunk for the next step (``training.follow.steps``: the chunks of one
        look step together); step when the held rows reach the batch size."""
        if self.keyed.hold(chunk):
            self.step_keyed()
        self._maybe_cut()

    def step_keyed(self) -> None:
        lv = self.loaded
        if lv is None or not self.keyed.held:
            return
        units = {c.start.unit for c in self.keyed.held}
        rows = self.keyed.step(lv.ctx, lambda batch: self._forward(lv, batch))
        if self.rewinder is not None and self.rewinder.rewind(lv.vdir, lv.cluster.stores, self.settle):
            self._changed = True  # the rewound rows: the next delta, cut now
            self.cut()
        if rows is not None:
            self.result.files += sorted(units - set(self.result.files))
            self.result.rows += rows
            self.result.steps += 1
            self._changed = True

    def _forward(self, lv: Loaded, batch) -> torch.Tensor:
        """The step's logits; with full versions, the batch is scored by the served network too."""
        logits = lv.ctx.forward(batch)
        return logits if self.full is None else self.full.split(logits, batch.labels)

    def _maybe_full(self) -> None:
        """Between two chunks, when one is due: the last delta into the served version, a full
        version, the gate; published, the next deltas go into it (a canary: into the served one)."""
        if self.full is None or self.loaded is None or not self.full.due(len(self.result.deltas)):
            return
        self.cut()
        version = self.full.write(self.loaded, self.ledger.positions(), len(self.result.deltas))
        if self.full.publish(version):
            mdir = Path(self.cfg.store) / self.cfg.model
            self._announce(mdir / version, version, notices.VERSION, mdir / ms.CURRENT)
            self._follow_current()

    def _announce(self, vdir: Path, version: str, seq: int, marker: Path) -> None:
        """Tell serving (--announce) of delta ``seq`` of ``version`` (VERSION: CURRENT moved to it)."""
        notices.announce(self.announcer, vdir.parent, version, seq, marker.stat().st_mtime)

    def _maybe_cut(self) -> None:
        if self.cutter.published():
            self.settle()  # the ledger committed as soon as the delta in flight is published
        read_on = self._changed or self.book.moved(self.ledger.positions())  # duplicates only: a delta too
        if read_on and self.cutter.due() and self.job.world == 1:  # ranks cut at a look
            self.cut(wait=False)

    def cut(self, wait: bool = True) -> int | None:
        """Cut the rows changed since the last delta as the version's next delta and commit the
        ledger (``training.follow.cut.DeltaCut``'s steps); returns its seq (None: nothing changed).
        In-process tables' rows and the record are taken here and written on the cut's own thread
        (``wait``: until published; else training goes on, ``settle`` commits the ledger)."""
        lv = self.loaded
        if lv is None:
            return None
        self.step_keyed()  # what was handed over is in the delta
        self.settle()  # one delta in flight at a time
        began = time.perf_counter()
        if self.job.world > 1:
            self.cutter.begin()
            lv.ctx.flush()  # every sparse update applied before the dump
            seq = cut_together(self.job, lv.cluster, lv.vdir, self.book, self.ledger, self._changed)
            self._changed = False
            self.result.deltas += [(lv.version, seq)] if seq is not None else []
            if seq is not None and self.job.rank == 0:
                self.cutter.announce(lv.vdir, seq)
            if seq is not None:  # every rank: how long the cut held its step (rank 0 wrote it)
                self.book.cut_took(time.perf_counter() - began)
            return seq
        if DeltaCut.empty(self._changed, self.book.moved(self.ledger.positions())):
            self.cutter.begin()
            lv.ctx.flush()
            self.ledger.commit()  # e.g. unreadable files: nothing to publish, but remember them
            return None
        seq = lv.cluster.stores[0].delta_seq + 1
        pending = self.cutter.take(lv, seq, self.book, self.ledger, began)  # 1-6
        self._changed = False
        self.result.deltas.append((lv.version, seq))
        if self.rewinder is not None:
            self.rewinder.cut(seq)
        if wait or not pending.threaded:
            self.settle()  # 7
        held = time.perf_counter() - began
        self.book.cut_took(held)
        log.info("delta %s/%d cut in %.0f ms (training held)", lv.version, seq, held * 1e3)
        return seq

    def settle(self) -> None:
        """Wait for the delta in flight (``cut``); published, the ledger commits what it holds."""
        self.cutter.settle(self.ledger, self.book)

    # ---- loading a version -----------------------------------------------------------------------
    def _load(self, version: str) -> Loaded:
        lv = follow_tables.load_version(self.cfg, version, self.job, self.full)
        last = lv.cluster.stores[0].delta_seq if lv.cluster.stores else self.job.seq
        if self.rewinder is not None:
            self.rewinder.loaded(version, last)
        log.info("following %s/%s: %d shards, deltas up to %d applied", self.cfg.model, version,
                 lv.manifest.num_shards, last)  # fmt: skip
        return lv

    def _unload(self) -> None:
        if self.loaded is not None:
            lv, self.loaded = self.loaded, None
            try:
                lv.ctx.close()
            finally:
                lv.cluster.close()
            del lv
            memory.trim()  # the old version's tables, back to the system (serving/memory.py)

    def close(self) -> None:
        try:
            self.settle()  # after an exception too: the delta in flight is whole, or never done
        except Exception:
            log.exception("the delta in flight failed")
        self.cutter.close()
        if self.full is not None:
            self.full.settle()
        if self.lock is not None:
            self.lock.close()
        if self.announcer is not None:
            self.announcer.close()
            self.announcer = None
        self.book.close()
        self._unload()

    def __enter__(self) -> FollowTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
