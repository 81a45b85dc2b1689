"""Export a trained model into the model store (layout in model_store/layout.py).

``VersionWriter`` stages ``<root>/<model>/.staging-<v>-<id>/`` when training starts, so the deltas
cut while training (``DeltaTrigger``) land in the version being written; ``finish`` adds the full
embedding dumps, the schema, the dense model (every registered runtime, each verified on the test
rows and timed: ``training.export_dense``), the trainer's own test scores and the manifest, then
seals the version (``_SUCCESS`` last, atomic rename). ``abort`` removes a version that never finished.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from torch import nn

import model_store
from features.batch import CompactBatch
from features.schema import Schema, dump_schema
from model_store import shards
from training.export_dense import export_dense
from training.quantcheck import check_quantized

log = logging.getLogger("recserve.train")

SCORES = "eval/scores.npy"
"""The version's test scores, as it serves them (offline scoring and every online path match it)."""
SCORES_FLOAT32 = "eval/scores_float32.npy"
"""A version served in float16 or int8: the trainer's float32 scores of the same rows."""


class DeltaTrigger:
    """Says when to cut a delta: every ``interval_s`` seconds and/or every ``rows`` training rows."""

    def __init__(self, interval_s: float = 0.0, rows: int = 0, clock=time.monotonic):
        self.interval_s, self.rows, self.clock = interval_s, rows, clock
        self._last = clock()
        self._rows = 0

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0 or self.rows > 0

    def due(self, new_rows: int) -> bool:
        """Count ``new_rows`` trained; True (and reset) when a trigger fired."""
        self._rows += new_rows
        fired = (self.interval_s > 0 and self.clock() - self._last >= self.interval_s) or (
            self.rows > 0 and self._rows >= self.rows
        )
        if fired:
            self._last, self._rows = self.clock(), 0
        return fired


class VersionWriter:
    """One new version of ``model`` under ``root``, staged until ``finish``."""

    def __init__(self, root: str | Path, model: str, serving_dtype: str = "float32"):
        self.root, self.model = Path(root), model
        self.serving_dtype = serving_dtype
        """Row type the version's shards and deltas are written in (``TableSpec.serving_dtype``)."""
        self.version = model_store.next_version(self.root, model)
        self.staging = model_store.staging_dir(self.root, model, self.version)
        self.deltas = 0

    def cut_delta(self, cluster) -> Path:
        """Dump every shard's changed rows into ``deltas/<seq>/`` and mark it done."""
        path = model_store.delta_dir(self.staging, self.deltas)
        cluster.dump(path, delta=True)
        shards.encode_dump(path, self.serving_dtype)
        model_store.mark_done(path)
        self.deltas += 1
        return path

    def finish(
        self,
        cluster,
        model: nn.Module,
        model_config: dict,
        schema: Schema,
        evaluation,
        train: model_store.TrainRecord | None = None,
        test: Callable[[], Iterable[CompactBatch]] | None = None,
    ) -> Path:
        """Write the full version from the current (flushed) PS state and seal it. A version in a
        reduced-precision serving dtype scores the ``test`` batches (the split ``evaluation`` scored)
        again with its served rows, recorded as the manifest's ``quantized``; those scores are the
        version's ``eval/scores.npy`` (the float32 ones: ``eval/scores_float32.npy``)."""
        d = self.staging
        cluster.dump(d / "embeddings")
        shards.encode_dump(d / "embeddings", self.serving_dtype)
        quantized, scores = None, evaluation.scores
        (d / SCORES).parent.mkdir(parents=True, exist_ok=True)
        if self.serving_dtype != "float32":
            if test is None:
                raise ValueError(f"a {self.serving_dtype} export needs the test split to check its scores")
            np.save(d / SCORES_FLOAT32, evaluation.scores.astype(np.float32))
            quantized, scores = check_quantized(
                d, self.serving_dtype, cluster.num_shards, schema, model, test(), evaluation
            )
            log.info("served in %s: test AUC %.5f (float32 %.5f), max |score diff| %.2g", quantized.dtype,
                     quantized.auc, quantized.float32_auc, quantized.max_abs_score_diff)  # fmt: skip
        (d / "schema.yaml").write_text(dump_schema(schema))
        exported = export_dense(model, d, evaluation.pooled, evaluation.dense)
        np.save(d / SCORES, scores.astype(np.float32))
        parent = model_store.versions(self.root, self.model)
        manifest = model_store.VersionManifest(
            model=self.model,
            version=self.version,
            parent=parent[-1] if parent else None,
            schema_fingerprint=schema.fingerprint,
            model_config=model_config,
            dim=model_config["dim"],
            num_shards=cluster.num_shards,
            dense=exported.files,
            dense_runtime=exported.timing,
            metrics=evaluation.metrics() | {f"{k}_max_abs_diff": v for k, v in exported.max_abs_diff.items()},
            deltas=self.deltas,
            train=train,
            quantized=quantized,
        )
        model_store.write_manifest(d, manifest)
        final = model_store.seal(d, model_store.version_dir(self.root, self.model, self.version))
        log.info("exported %s (AUC %.4f)", final, evaluation.auc)
        return final

    def abort(self) -> None:
        model_store.discard(self.staging)
