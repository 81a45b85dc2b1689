"""Score data offline from an exported version, with nothing of the trainer's state.

Loads what serving loads (manifest + checksums, schema.yaml, embedding shard dumps into
in-process stores, the TorchScript dense model), runs the same worker in inference mode and
returns probabilities. The export round-trip test runs this in a fresh process and compares it
with the trainer's own ``eval/scores.npy``::

    python -m training.offline artifacts/criteo/1 data/criteo/wide_resdnn_criteo_test.tsv out.npy
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import model_store
from features.schema import load_schema
from features.stream import ReadOptions
from features.transform import dense_matrix
from training.data import Split
from training.evaluate import sigmoid


def load_stores(version: Path, manifest: model_store.VersionManifest) -> list:
    """``open_stores`` of a sealed version, by its manifest."""
    return open_stores(version, manifest.num_shards, manifest.schema_fingerprint, manifest.version)


def open_stores(version: Path, num_shards: int, schema_hash: str, name: str) -> list:
    """One TableShard per shard, filled from ``embeddings/shard-<i>-of-<n>/``: the rows serving
    reads (an int8 version's dequantized by ``model_store.quant.dequantize``, as serving does: a
    version in a plain float type is held in it, one of codes in float32)."""
    from model_store.quant import row_codec
    from model_store.shards import read_meta, shard_dir_name
    from serving.ps.shard import TableShard, TableShardConfig
    from serving.ps.spec import TableSpec

    n = num_shards
    stores = []
    for i in range(n):
        shard = version / "embeddings" / shard_dir_name(i, n)
        meta = read_meta(shard)
        cfg = TableShardConfig(
            table=TableSpec(
                dim=meta.dim,
                capacity=max(1, meta.rows),
                dtype=meta.dtype if row_codec(meta.dtype).plain else "float32",
            ),
            schema_hash=schema_hash,
            shard=i,
            num_shards=n,
        )
        store = TableShard(cfg)
        store.load(shard)
        store.version = name  # what pinned lookups name
        stores.append(store)
    return stores


def score(version: str | Path, data: str | Path, batch_size: int = 2048, dense_format: str = "torchscript"):
    """Probabilities for every row of ``data`` from the artifacts of ``version`` alone."""
    from model_store.dense import load_dense
    from serving.worker.core import EmbeddingWorker, InProcessShard

    version = Path(version)
    manifest = model_store.read_manifest(version)  # refuses incomplete or corrupt versions
    schema = load_schema(version / "schema.yaml")
    if schema.fingerprint != manifest.schema_fingerprint:
        raise model_store.ModelStoreError(f"{version}: schema.yaml does not match the manifest fingerprint")
    dense = load_dense(version / manifest.dense[dense_format])
    worker = EmbeddingWorker([InProcessShard(s) for s in load_stores(version, manifest)], schema)
    try:
        logits = [
            dense(worker.forward(b).pooled, dense_matrix(b, schema))
            for b in Split(data, schema, ReadOptions()).batches(batch_size)
        ]
    finally:
        worker.close()
    return sigmoid(np.concatenate(logits))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        print("usage: python -m training.offline VERSION_DIR DATA OUT.npy", file=sys.stderr)
        return 2
    np.save(argv[2], score(argv[0], argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
