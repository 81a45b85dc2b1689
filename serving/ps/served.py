"""A serving shard's snapshot (``Served``): its version's table, the overlay of the rows its deltas
changed, and which version and delta they are, as one immutable value that ``MappedTableShard``
(serving/ps/mapped.py) flips by reference. A delta makes a new one (``with_deltas``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from model_store.shards import ShardData
from serving.ps.config import is_next_delta
from serving.ps.table import BucketTable

__all__ = ["Served"]


@dataclass(frozen=True)
class Served:
    """What a serving shard answers from, as one immutable value."""

    base: BucketTable
    overlay: BucketTable
    version: str = ""
    delta_seq: int = -1
    rows: int = 0
    """Live rows: the version's, plus the ones deltas added, minus the ones they deleted."""

    @classmethod
    def of(cls, base: BucketTable, version: str, delta_seq: int) -> Served:
        overlay = BucketTable.empty(base.dim, base.dtype)  # rows of the base's type: answered as stored
        return cls(base, overlay, version, delta_seq, len(base))

    def with_deltas(self, deltas: list[ShardData]) -> Served:
        """This snapshot with ``deltas`` applied in seq order, in ONE new overlay (self is
        unchanged): a shard that loads a version with a thousand deltas builds its overlay once,
        not once a delta (each build costs the whole overlay: a thousand made a restart quadratic).
        Deltas already applied are skipped; a gap in the sequence is refused. Deletions and rows of
        the same delta: the row wins, as in the training store; across deltas the later wins."""
        deltas = [d for d in deltas if d.meta.delta_seq > self.delta_seq]
        if not deltas:
            return self
        seq = self.delta_seq
        for data in deltas:  # those applied already were dropped above: each must be the next
            is_next_delta(data.meta, self.version, seq)
            seq += 1
        o, dim = self.overlay, self.base.dim
        # each delta's rows in the overlay's (the base's) serving dtype: as they are where they are
        # in it already (an int8 version's int8 deltas: their codes and scales), else re-encoded
        deltas = [d if d.meta.dtype == o.dtype else d.decoded().encoded(o.dtype) for d in deltas]
        # each delta's deletions, then its rows (the row wins); the last occurrence of a sign wins
        signs = np.concatenate([a for d in deltas for a in (d.deleted, d.signs)])
        rows = np.concatenate([a for d in deltas for a in (
            np.zeros((len(d.deleted), dim), o.rows.dtype), d.rows)])  # fmt: skip
        dead = np.concatenate([a for d in deltas for a in (
            np.ones(len(d.deleted), np.bool_), np.zeros(len(d.signs), np.bool_))])  # fmt: skip
        qparams = None
        if o.qparams is not None:
            qparams = np.concatenate([a for d in deltas for a in (
                np.zeros((len(d.deleted), 2), o.qparams.dtype), d.qparams)])  # fmt: skip
        _, first = np.unique(signs[::-1], return_index=True)
        keep = len(signs) - 1 - first
        signs, rows, dead = signs[keep], rows[keep], dead[keep]
        # live rows: each sign's state before (the overlay over the base) against after
        slots = o.find(signs)
        was = np.zeros(len(signs), np.bool_)
        in_overlay = slots >= 0
        was[in_overlay] = ~o.dead[slots[in_overlay]] if len(o.dead) else True
        was[~in_overlay] = self.base.find(signs[~in_overlay]) >= 0
        live = self.rows + int((~dead).sum()) - int(was.sum())
        overlay = o.upserted(signs, rows, dead, None if qparams is None else qparams[keep], slots=slots)
        return Served(self.base, overlay, self.version, seq, live)
