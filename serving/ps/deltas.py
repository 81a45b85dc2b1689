"""Write deltas into a model-store version from outside a training run.

``DeltaWriter`` loads a version's embedding shards into in-process stores (one per shard, routed
like the PS), lets the caller change rows (``assign``) and cuts each change set as the next
``deltas/<seq>/`` of that version: every shard's delta, then the delta's ``_SUCCESS``. It starts
from what serving holds: the full dump plus the version's existing deltas, in order. The serving
PS shards following the model apply it within their poll interval. Used by the demo, the
hot-swap benchmark and the tests; continuous training (``recserve train --follow``) writes the
same layout.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

import model_store as ms
from features.hashing import shard_of
from serving.notices import Announcer, announce


class DeltaWriter:
    def __init__(self, root, model: str, version: str | None = None):
        from serving.ps.spec import TableSpec
        from serving.ps.store import EmbeddingStore, StoreConfig

        version = version or ms.current(root, model)
        if version is None:
            raise ms.ModelStoreError(f"{model}: nothing published")
        self.version: str = version
        self.vdir = ms.version_dir(root, model, self.version)
        manifest = ms.read_manifest(self.vdir, verify=False)
        self.num_shards, self.dim = manifest.num_shards, manifest.dim
        self.stores = []
        for i in range(self.num_shards):
            store = EmbeddingStore(
                StoreConfig(
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

    def publish(self, announcer: Announcer | None = None) -> tuple[int, Path, float]:
        """Cut the changes so far as the next delta and mark it done (``cut``, then ``done``);
        returns (seq, its directory, the time its ``_SUCCESS`` was written)."""
        seq, ddir = self.cut()
        return seq, ddir, self.done(seq, ddir, announcer)

    def cut(self) -> tuple[int, Path]:
        """Write the changes so far as the next delta's parts, without its ``_SUCCESS``: no follower
        reads it yet. Returns (seq, its directory)."""
        seq = self.stores[0].delta_seq + 1
        ddir = ms.delta_dir(self.vdir, seq)
        for store in self.stores:
            store.dump_delta(ddir)
        ms.shards.encode_delta(ddir, self.vdir)  # in the version's serving dtype
        return seq, ddir

    def done(self, seq: int, ddir: Path, announcer: Announcer | None = None) -> float:
        """Write delta ``seq``'s ``_SUCCESS`` and announce it on ``announcer`` (``serving.notices``):
        followers apply it from now on, at once where they listen. Returns the marker's time."""
        ms.mark_done(ddir)
        written = (ddir / ms.SUCCESS).stat().st_mtime
        announce(announcer, self.vdir.parent, self.version, seq, written)
        return written
