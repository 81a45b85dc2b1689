r"""A PS shard following its model in the model store: new versions and deltas, live.

``Follower.poll()`` (called by the server off the event loop, on a thread at normal priority
(``follow_beside_requests``), at each notice
that ``wants`` names something new -- ``serving.notices`` -- and every ``poll_s`` anyway) reads
``<model>/CURRENT`` (or serves the ``pin``\ ned version). A new version passes the one gate
(``model_store.validate`` against the manifest of the version served: ``_SUCCESS``, manifest,
the same feature schema and dim), then is
opened in a staging store beside the served one -- a serving ``MappedTableShard`` maps this shard's
files and checks their checksums through the mapping; a dump of another shard count is re-sharded by
the routing hash in memory -- its deltas are applied there, and the served store *adopts* it in
one step (a reference flip for a MappedTableShard): a lookup sees the old version or the new one with
its deltas, never a mix. Then every complete delta of the served version with a higher seq is
applied in seq order, each atomically (a new overlay, flipped; gaps are refused; deltas carry
values, so re-applying one is a no-op), in one of the host's apply slots (``APPLY_SLOTS``): every
serving process of a host learns of a delta at the same moment, and they apply it in turns. Every
shard checks every shard's part of a delta first, so a delta corrupt anywhere is refused
everywhere. A version or delta that fails validation is
logged once, counted (``recserve_version_refusals_total{component="ps"}``: ``serving.versions``) and skipped; the
shard keeps serving what it has, and ``refusal`` says why it does not serve the version CURRENT
names.

Freshness -- time from a delta's ``_SUCCESS`` to the delta being visible in lookups -- goes to the
``recserve_ps_delta_freshness_seconds`` histogram.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path
from typing import Protocol

import model_store as ms
from model_store import ModelStoreError, shards
from model_store.errors import StoreError
from model_store.shards import ShardData
from serving import memory
from serving.priority import host_slot, loading_beside_requests
from serving.ps.config import TableShardConfig
from serving.versions import VersionTarget

log = logging.getLogger("recserve.ps.follow")

APPLY_SLOTS = max(1, (os.cpu_count() or 1) // 4)
"""Followers that may apply deltas at once on a host, over every serving process on it (PS shards,
co-located scoring processes): a delta wakes them all at the same moment. On the 2-vCPU dev VM two
PS shards and a TorchServe worker's two co-located shards spent 6 ms of CPU each per 10,000-row
delta, together, and took both cores from the requests that came then. One at a time leaves a
core to the requests: ``python -m loadtest.bench_swap --lookups colocated --rounds 1``,
interleaved 2 x 2, the deltas' windows' p99 1.17 and 1.08x steady, against 1.75 and 2.15x (their
placebo p90 1.01-1.08); a delta in use in every co-located shard after p50 31-36 ms, against
27-31 ms."""
APPLY_WAIT_S = 1.0
"""How long a follower waits for an apply slot before it applies without one (``host_slot``)."""


class FollowedShard(Protocol):
    """What a ``Follower`` keeps current: a serving PS's ``MappedTableShard`` (serving/ps/mapped.py) or a
    training shard's ``TableShard`` (serving/ps/shard.py, a test's or a tool's copy of what is
    served)."""

    @property
    def config(self) -> TableShardConfig: ...
    @property
    def version(self) -> str: ...
    @property
    def delta_seq(self) -> int: ...
    @property
    def flip_bytes(self) -> int:
        """Bytes of deltas to read before one ``apply_deltas_data`` (0: apply each as it is read)."""
        ...

    def staging(self) -> FollowedShard:
        """An empty store of the same configuration, to build the next version in."""
        ...

    def open(self, paths, version: str | None = None) -> int: ...
    def adopt(self, other) -> int:
        """Serve what ``other`` (a staging store) built, in one step."""
        ...

    def read(self, paths, delta: bool = False) -> ShardData:
        """This shard's part of a dump or delta, read and verified; no store state touched."""
        ...

    def apply_deltas_data(self, deltas: list[ShardData]) -> int:
        """Apply ``deltas`` (read, in seq order): in one flip where the store serves snapshots (a
        ``MappedTableShard``), else one after another. Returns the rows of those applied."""
        ...


class Follower:
    def __init__(self, store: FollowedShard, model_dir: str | os.PathLike, registry=None, clock=time.time,
                 pin: str = ""):  # fmt: skip
        self.store = store
        self.model_dir = Path(model_dir)
        self.root, self.model = self.model_dir.parent, self.model_dir.name
        self.versions = VersionTarget(self.root, self.model, "ps", pin, registry)
        """What to serve (the pin, or CURRENT) and what was refused: shared with the controller and
        the lean frontend (serving/versions.py)."""
        self.served_manifest: ms.VersionManifest | None = (
            None  # of the version served: the gate compares with it
        )
        self.clock = clock
        self.refusal = ""
        """Why the target version (CURRENT's, or the pin) is not served ('' when it is, or it was
        not refused)."""
        self.target: str | None = None  # as of the last poll
        self.freshness = None
        self.visible: tuple[int, float] = (-1, 0.0)
        """(seq, seconds from its _SUCCESS to the flip) of the last delta applied."""
        self.switch_s = 0.0  # how long the last version switch took (read, verify, deltas, flip)
        self.slot_timeouts = 0
        """Passes that applied deltas without a turn, no apply slot having come free in
        ``APPLY_WAIT_S`` (on /metrics through serving/freshness.py)."""
        if registry is not None:
            from prometheus_client import Histogram

            self.freshness = Histogram(
                "recserve_ps_delta_freshness_seconds",
                "Time from a delta's _SUCCESS to the delta being visible in lookups",
                buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30, 60),
                registry=registry,
            )

    @property
    def pin(self) -> str:
        return self.versions.pin

    def wants(self, notice) -> bool:
        """Whether a notice (``serving.notices.Notice``) names what this follower does not serve yet:
        a new CURRENT (unpinned), or a delta after the one served of the version served or wanted."""
        served = self.store.version
        if notice.delta_seq < 0:  # CURRENT moved
            return not self.pin and notice.version != served
        if notice.version == served:
            return notice.delta_seq > self.store.delta_seq
        return notice.version == (self.pin or self.target)

    def poll(self, turn: bool = True) -> list[str]:
        """One pass: switch to a new CURRENT version (with ``turn``, in one of the host's load turns:
        ``serving.priority.loading_beside_requests``), then apply new deltas, in one of the host's
        apply slots (``turn``; a process that serves nothing yet, loading at low priority, takes
        none: holding one there would keep the serving followers waiting; a co-located shard loads
        its version inside its scorer's turn). Returns what it did."""
        events: list[str] = []
        self.target = target = self.versions.target()
        if target and self.versions.wanted(target, self.store.version):  # wanted() is False without one
            try:
                # beside requests (``turn``): in the host's load turn, the GIL handed over finely
                with loading_beside_requests("ps-load") if turn else contextlib.nullcontext():
                    events.append(self._switch(target))
            except (ModelStoreError, StoreError, OSError) as e:
                self.versions.refuse(target, f"not switching to version {target}: {e}")
        self.refusal = self.versions.refusal(target, self.store.version)
        if self.store.version:
            events.extend(self._apply_deltas(self.store.version, self.store, turn=turn))
        return events

    def _switch(self, version: str) -> str:
        """Build the new version's complete state -- full dump plus its deltas -- in a staging store
        beside the served one, then flip once: no lookup sees the new version without its deltas.
        A serving shard (MappedTableShard) maps and verifies the version's files here and the flip is a
        reference assignment; the old version is released when its last lookup finishes."""
        vdir = ms.version_dir(self.root, self.model, version)
        # the one gate (model_store.validate) without the checksum of every file: this shard's own
        # files are checked by the store as it reads or maps them
        manifest = ms.validate(self.root, self.model, version, self.served_manifest, verify=False)
        t0 = time.perf_counter()
        staging = self.store.staging()
        staging.open(vdir / "embeddings", version)
        applied = self._apply_deltas(version, staging, observe=False)
        old = self.store.version or "(none)"
        rows = self.store.adopt(staging)  # the atomic flip, deltas included
        self.served_manifest = manifest
        del staging
        memory.trim(collect=False)  # the deltas read for the flip (beside requests: serving/memory.py)
        self.switch_s = time.perf_counter() - t0
        msg = (f"version {old} -> {version}: {rows} rows, deltas up to {self.store.delta_seq} "
               f"({len(applied)} applied before the flip) in {self.switch_s:.2f}s")  # fmt: skip
        log.info(msg)
        return msg

    def _apply_deltas(
        self, version: str, store: FollowedShard, observe: bool = True, turn: bool = False
    ) -> list[str]:
        """Apply the version's complete deltas after the store's, in seq order, those read so far
        in one ``apply_deltas_data`` once they reach the store's ``flip_bytes`` (a serving
        ``MappedTableShard`` builds an overlay per call: a shard loading a version with a thousand deltas
        builds it a few times, not a thousand times). A delta that cannot be read or applied is
        refused; the ones before it are applied. ``turn``: in one of the host's ``APPLY_SLOTS``,
        taken only when there is a delta to apply."""
        vdir = ms.version_dir(self.root, self.model, version)
        seqs = [
            seq
            for seq in ms.list_deltas(vdir, after=store.delta_seq)
            if not self.versions.is_refused(version, seq)
        ]
        if not seqs:
            return []
        if not turn:
            return self._apply(version, store, vdir, seqs, observe)
        with host_slot("apply", APPLY_SLOTS, wait_s=APPLY_WAIT_S) as held:
            self.slot_timeouts += not held
            return self._apply(version, store, vdir, seqs, observe)

    def _apply(
        self, version: str, store: FollowedShard, vdir: Path, seqs: list[int], observe: bool
    ) -> list[str]:
        events: list[str] = []
        batch: list[tuple[int, Path, ShardData]] = []
        held = 0  # bytes of the batch's arrays
        for seq in seqs:
            ddir = ms.delta_dir(vdir, seq)
            try:
                _verify_other_parts(ddir, store.config)  # corrupt in any shard: refused by every shard
                data = store.read(ddir, delta=True)
                if data.meta.delta_seq != seq:
                    raise StoreError(f"delta directory {seq} holds delta seq {data.meta.delta_seq}")
            except (StoreError, OSError, ValueError) as e:
                self.versions.refuse(version, f"delta {seq} of version {version} refused: {e}", seq)
                break  # later deltas build on this one
            batch.append((seq, ddir, data))
            held += data.nbytes
            if held >= store.flip_bytes:
                if not self._flip(version, store, batch, events, observe):
                    return events
                batch, held = [], 0
        self._flip(version, store, batch, events, observe)
        return events

    def _flip(self, version: str, store: FollowedShard, batch, events: list[str], observe: bool) -> bool:
        """Apply ``batch`` ((seq, dir, data) in seq order) in one step; False when one was refused
        (tried one at a time to name it; those before it stay applied)."""
        if not batch:
            return True
        before = store.delta_seq
        try:
            written = store.apply_deltas_data([data for _, _, data in batch])
        except (StoreError, ValueError) as e:
            if len(batch) > 1:
                return all(self._flip(version, store, [one], events, observe) for one in batch)
            seq = batch[0][0]
            self.versions.refuse(version, f"delta {seq} of version {version} refused: {e}", seq)
            return False
        now = self.clock()
        for seq, ddir, data in batch:
            lag = now - (ddir / ms.SUCCESS).stat().st_mtime
            if observe:
                self.visible = (seq, lag)
            if self.freshness is not None and observe:
                self.freshness.observe(max(lag, 0.0))
            n = written if len(batch) == 1 else len(data.signs) if seq > before else 0
            events.append(
                f"delta {seq}: {n} rows, {len(data.deleted)} deleted, visible {lag:.2f}s after _SUCCESS"
            )
        return True


def _verify_other_parts(ddir: Path, config) -> None:
    """Check the checksums of the other shards' parts of a delta (deltas are small), so that the
    shards apply a delta all together or not at all. This shard's own part is checked as
    ``store.read`` reads it; with another shard count every part is read there anyway."""
    own = shards.shard_dir_name(config.shard, config.num_shards)
    for part in shards.shard_dirs(ddir):
        if part.name != own:
            shards.read_shard(part)


def not_serving_reason(store, follower) -> str:
    """Why a shard serves no version ('' when it serves one, or does not follow the model store:
    a training shard or one loaded with ``--load`` serves what it holds)."""
    if follower is None or store.version:
        return ""
    cfg = store.config
    why = follower.versions.not_serving(follower.versions.target())
    return f"embedding shard {cfg.shard} of {cfg.num_shards} serves no version: {why}"


def follow_beside_requests() -> None:
    """Set up a follower thread that shares its process's interpreter with the requests (a PS's
    event loop, a scoring process's co-located lookups): it runs at normal priority.

    It ran at nice 10, which inverted priorities: a nice thread holding the GIL, preempted by the
    scheduler on a busy host, kept every request waiting for it until it ran again. Lookups of
    4,000 IDs beside a follower applying the soak's deltas every 40 ms, two busy processes on the
    2 vCPUs: max 19 and 145 ms at nice 10, 7.9 and 8.0 ms at normal priority (a 1 ms GIL switch
    interval made no difference at normal priority). Its checksum passes are paced instead
    (``shards.VERIFY_DUTY``)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 0)
    except (AttributeError, OSError):  # not Linux, or not permitted: as it was
        pass
