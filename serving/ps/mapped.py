"""The store of a serving PS shard: an immutable version, memory-mapped, plus a delta overlay.

Serving needs keys, rows and an index; no optimizer state, no touch counters, no capacity. A
``MappedTableShard`` serves one ``Served`` snapshot (serving/ps/served.py): the version's
``BucketTable`` (mapped read-only from the model store, serving/ps/table.py), an in-memory overlay
``BucketTable`` of the rows its deltas changed or added (deleted signs as tombstones), the version
name and the last delta applied. Snapshots are immutable; every change builds a new one beside the
served one and *flips a reference*:

- a delta: a new overlay, the old one with the delta's rows merged into its bucket order (copies
  of the overlay and a sort of the delta's signs, off the event loop);
- a full switch: the new version is mapped and verified beside the old one, its deltas applied,
  then the flip. No O(rows) copy, no lock, no stall of lookups; memory peaks at old + new, and
  the old version's pages are released when the last lookup holding it finishes.

A lookup reads the reference once, so it sees one version and one delta seq, entirely.

Version-pinned lookups: a lookup may name the version it wants (the one its dense model was
exported with). After a full switch the replaced snapshot is *kept*, answering the lookups that
name it, until none has named it for ``keep_s`` seconds (``release_idle``, called by the
follower); so during a switch a shard holds both versions and a scoring process still on the old
dense model keeps reading the old rows, never the new ones. A version the shard does not hold
is refused (``NotServing``: UNAVAILABLE naming the shard and what it holds), never answered from
another version.

When a dump cannot be mapped as it is -- it was written with another shard count (re-sharded by
the routing hash), by an older format, or ``dtype`` asks for float16 rows of a float32 version --
the table is built in memory instead (the same structure, the same lookups).

A version exported in int8 (``model_store.quant``) is served as it lies: uint8 codes and each
row's fp16 scale and bias mapped, dequantized by the gather; its (int8) deltas' codes and scales
go into an int8 overlay as they are. The overlay always holds the base's row type, so a lookup
can also be answered as stored (``stored_rows_of``: a PS's gRPC answer, decoded by its caller).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import NoReturn

import numpy as np

from features.hashing import has_duplicates
from model_store import shards
from model_store.errors import StoreError
from model_store.meta import ShardMeta
from model_store.quant import StoredRows, bytes_per_row, row_codec
from model_store.shards import ShardData
from serving import memory
from serving.ps.config import TableShardConfig, as_signs, not_held
from serving.ps.served import Served
from serving.ps.table import BucketTable

__all__ = ["MappedTableShard"]

MERGE_BYTES = 4 << 20
"""Bytes of deltas (all their arrays) a follower reads before one overlay build (``flip_bytes``),
or the overlay's own bytes where it is larger (each build copies the overlay: the copies cost at
most as much as the deltas merged). Memory stays bounded however many deltas a version has. A
shard starting on the soak's version with its 1,005 small deltas: all in one build peaked 48 MB
over its start and kept 8 MB of fragmented heap after ``memory.trim``; in builds of 4 MB, 10 MB
and 2 MB, in the same 0.7-0.9 s."""


class MappedTableShard:
    """A serving shard's rows: ``lookup`` only; versions and deltas flip in whole."""

    read_only = True

    def __init__(self, config: TableShardConfig, keep_s: float = 30.0, clock=time.monotonic):
        self.config = config
        self.served = Served.of(BucketTable.empty(config.dim, config.dtype), "", -1)
        self.kept: dict[str, Served] = {}
        """Versions replaced by a switch, still answering lookups that name them."""
        self.keep_s = keep_s
        """A kept version is released once no lookup has named it for this long."""
        self.clock = clock
        self._named: dict[str, float] = {}  # kept version -> when a lookup last named it (or it was kept)
        self.hits = self.misses = 0
        self.switch_s = 0.0
        self.verify_duty = 1.0
        """How busy the checksum pass of the next ``open`` is (``shards.VERIFY_DUTY`` when a
        version is being served beside it, full speed when nothing is)."""

    # ---- what is served ---------------------------------------------------------------------
    @property
    def version(self) -> str:
        return self.served.version

    @version.setter
    def version(self, value: str) -> None:
        self.served = replace(self.served, version=value)

    @property
    def delta_seq(self) -> int:
        return self.served.delta_seq

    def __len__(self) -> int:
        return self.served.rows

    def __contains__(self, sign) -> bool:
        s = self.served
        one = np.array([sign], dtype=np.uint64)
        if len(s.overlay) and (slot := s.overlay.find(one)[0]) >= 0:
            return not s.overlay.dead[slot]
        return bool(s.base.find(one)[0] >= 0)

    def held(self) -> list[tuple[str, int]]:
        """(version, delta seq) of every version a lookup can name: the newest first."""
        s = self.served
        return [(s.version, s.delta_seq)] * bool(s.version) + [(v, k.delta_seq) for v, k in self.kept.items()]

    def snapshot_for(self, version: str = "") -> Served:
        """The snapshot a lookup naming ``version`` reads ("" or the newest: the served one)."""
        s = self.served  # one read: base, overlay, version and seq belong together
        if not version or version == s.version:
            return s
        kept = self.kept.get(version)
        if kept is None:
            now = self.served
            if version == now.version:  # a switch to it landed since ``s`` was read
                return now
            holds = [now.version] * bool(now.version) + [v for v in self.kept if v != version]
            not_held(self.config, version, holds)
        self._named[version] = self.clock()
        return kept

    def lookup(self, signs, insert: bool = False, version: str = "") -> tuple[np.ndarray, int]:
        """Rows (float32, request order) of ``version`` ("" = the newest) and how many signs had
        none (answered with zeros)."""
        out, misses, _ = self.rows_of(signs, insert, version)
        return out, misses

    def rows_of(
        self, signs, insert: bool = False, version: str = ""
    ) -> tuple[np.ndarray, int, tuple[str, int]]:
        """``lookup`` returning what answered as a value: rows, misses and the (version, delta seq)
        of the one snapshot they were read from."""
        if insert:
            raise ValueError("a serving PS does not insert rows (lookups with insert=true go to training)")
        signs = as_signs(signs)
        s = self.snapshot_for(version)
        out = np.empty((len(signs), s.base.dim), dtype=np.float32)
        misses = self._read(s, lambda table, zero: table.gather(signs, out, zero))
        return out, misses, (s.version, s.delta_seq)

    def stored_rows_of(self, signs, version: str = "") -> tuple[StoredRows, int, tuple[str, int]]:
        """``rows_of`` as the version stores them, not decoded (a serving PS's answer to a
        ``stored`` lookup): ``decoded()`` of them is exactly what ``rows_of`` answers."""
        signs = as_signs(signs)
        s = self.snapshot_for(version)
        base, n = s.base, len(signs)
        qp = None if base.qparams is None else np.empty((n, 2), base.qparams.dtype)
        out = StoredRows(base.dtype, np.empty((n, base.dim), base.rows.dtype), qp)
        misses = self._read(s, lambda table, zero: table.gather_stored(signs, out, zero))
        return out, misses, (s.version, s.delta_seq)

    def _read(self, s: Served, gather) -> int:
        """Gather from ``s``'s base, then its overlay over it (``gather(table, zero_missing)`` ->
        slots); counts and returns the misses."""
        hit = gather(s.base, True) >= 0
        if len(s.overlay):
            slots = gather(s.overlay, False)
            found = slots >= 0
            hit[found] = ~s.overlay.dead[slots[found]]
        misses = len(hit) - int(hit.sum())
        self.hits += len(hit) - misses
        self.misses += misses
        return misses

    # ---- changing it ------------------------------------------------------------------------
    def staging(self) -> MappedTableShard:
        """An empty store of the same configuration, to build the next version in; its checksum
        pass is paced while this store serves lookups."""
        staging = MappedTableShard(replace(self.config))
        staging.verify_duty = shards.VERIFY_DUTY if self.served.version else 1.0
        return staging

    def open(self, paths, version: str | None = None) -> int:
        """Serve a full dump (this shard's part of it), mapped when its layout allows, verified
        before it serves. Returns rows."""
        t0 = time.perf_counter()
        base, meta = self._open_table(paths)
        new = Served.of(base, meta.version if version is None else version, meta.delta_seq)
        self._flip(new)
        if not self.config.schema_hash:
            self.config.schema_hash = meta.schema_hash
        self.switch_s = time.perf_counter() - t0
        return len(base)

    def adopt(self, other: MappedTableShard) -> int:
        """The flip: serve what ``other`` built (one reference assignment)."""
        self.config.schema_hash = other.config.schema_hash
        self._flip(other.served)
        return self.served.rows

    def _flip(self, new: Served) -> None:
        """Serve ``new``; the replaced version is kept for the lookups that still name it."""
        old = self.served
        if new.version in self.kept:  # back to a version still kept (a quick rollback): one copy
            self._drop(new.version)
        if old.version and old.version != new.version and old.base is not new.base:
            self.kept[old.version] = old
            self._named[old.version] = self.clock()
        self.served = new
        if (not old.version or old.version == new.version) and old.base is not new.base:
            old.base.release()  # here, off the event loop, not in whichever thread drops it last

    def release_idle(self) -> list[str]:
        """Release the kept versions no lookup has named for ``keep_s``; returns them."""
        now = self.clock()
        idle = [v for v in list(self.kept) if now - self._named.get(v, now) >= self.keep_s]
        for v in idle:
            self._drop(v)
        if idle:  # its overlay's arrays back to the system, as after a switch (serving/memory.py)
            memory.trim(collect=False)
        return idle

    def _drop(self, version: str) -> None:
        kept = self.kept.pop(version, None)
        self._named.pop(version, None)
        if kept is not None and kept.base is not self.served.base:
            kept.base.release()

    def read(self, paths, delta: bool = False) -> ShardData:
        """Read and verify this shard's part of a delta (full dumps go through ``open``)."""
        if not delta:
            raise StoreError("a serving PS opens full dumps with open(), not read()")
        data = shards.read_for_shard(paths, self.config.shard, self.config.num_shards, check=self._check)
        if data.meta.kind != "delta":
            raise StoreError(f"{paths}: is a {data.meta.kind} dump, expected a delta")
        if has_duplicates(data.signs):
            raise StoreError(f"{paths}: the delta holds duplicate signs; refusing it")
        return data

    def apply_delta_data(self, data: ShardData) -> int:
        return self.apply_deltas_data([data])

    @property
    def flip_bytes(self) -> int:
        """``Follower``'s protocol: each ``apply_deltas_data`` copies the overlay, so a follower
        reads ``MERGE_BYTES`` of deltas, or the overlay's bytes where larger, before one."""
        return max(MERGE_BYTES, self.served.overlay.nbytes)

    def apply_deltas_data(self, deltas: list[ShardData]) -> int:
        """Apply ``deltas`` (in seq order) in one flip; returns the rows of those applied."""
        before = self.served.delta_seq
        self.served = self.served.with_deltas(deltas)
        return sum(len(d.signs) for d in deltas if d.meta.delta_seq > before)

    def apply_delta(self, paths) -> int:
        return self.apply_delta_data(self.read(paths, delta=True))

    def _check(self, meta: ShardMeta, where: str) -> None:
        """Refuse a dump of another dim or feature schema (any row dtype is served)."""
        cfg = self.config
        shards.check_compatible(meta, cfg.dim, meta.dtype, cfg.schema_hash, where)

    def _open_table(self, paths) -> tuple[BucketTable, ShardMeta]:
        cfg = self.config
        dirs = shards.shard_dirs(paths)
        own = shards.shard_dir_name(cfg.shard, cfg.num_shards)
        if len(dirs) == cfg.num_shards and any(d.name == own for d in dirs):
            d = next(d for d in dirs if d.name == own)
            try:
                meta: ShardMeta | None = shards.read_meta(d)
            except StoreError:
                meta = None  # read_for_shard below says what is wrong with it
            if meta is not None and meta.bucket_bits is not None and meta.num_shards == cfg.num_shards:
                self._check(meta, str(d))
                table, meta = BucketTable.open(d, self.verify_duty)
                if cfg.dtype == "float16":  # rows of a plain float type narrowed once; codes stay codes
                    table = table.astype(np.float16)
                return table, meta
        data = shards.read_for_shard(paths, cfg.shard, cfg.num_shards, check=self._check)
        if data.meta.kind != "full":
            raise StoreError(f"{paths}: is a {data.meta.kind} dump, expected a full one")
        if has_duplicates(data.signs):
            raise StoreError(f"{paths}: the dump holds duplicate signs; refusing it")
        rows, dtype = data.rows, data.meta.dtype
        if cfg.dtype == "float16" and row_codec(dtype).plain:  # narrowed before the build: half its copies
            rows, dtype = rows.astype(np.float16), "float16"
        return BucketTable.build(data.signs, rows, qparams=data.qparams, dtype=dtype), data.meta

    # ---- introspection ----------------------------------------------------------------------
    @property
    def memory_bytes(self) -> int:
        return sum(s.base.nbytes + s.overlay.nbytes for s in (self.served, *self.kept.values()))

    @property
    def raw_bytes_per_row(self) -> int:
        s = self.served
        return 8 + bytes_per_row(s.base.dim, s.base.dtype)

    def stats(self) -> dict:
        s, cfg = self.served, self.config
        return {
            "shard": cfg.shard,
            "num_shards": cfg.num_shards,
            "dim": s.base.dim,
            "dtype": s.base.dtype,
            "rows": s.rows,
            "capacity": s.rows,  # a served version has no capacity: it is as big as it is
            "memory_bytes": self.memory_bytes,
            "mapped_bytes": s.base.nbytes if s.base.mapped else 0,
            "overlay_rows": len(s.overlay),
            "hits": self.hits,
            "misses": self.misses,
            "inserts": 0,
            "evictions": 0,
            "expired": 0,
            "grows": 0,
            "eviction": "none",
            "optimizer": "none",
            "step": 0,
            "version": s.version,
            "delta_seq": s.delta_seq,
            "held": self.held(),
        }

    def expire(self, now: float | None = None) -> int:
        return 0

    # ---- what a serving PS does not do ------------------------------------------------------
    def _read_only(self, what: str) -> NoReturn:
        raise StoreError(
            f"{what}: this PS serves a read-only version from the model store (ps-serve); "
            "updates and dumps go to a training PS (recserve ps)"
        )

    def apply_gradients(self, signs, grads, step: int = 0) -> int:
        self._read_only("update")

    def snapshot(self, copy: bool = True):
        self._read_only("dump")

    def cut_delta(self):
        self._read_only("dump")

    def install(self, data: ShardData) -> int:
        self._read_only("load of rows already read")
