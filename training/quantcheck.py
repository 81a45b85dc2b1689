"""The export's check of a version served in a reduced-precision dtype: score the test split with
the rows as served and compare with the trainer's float32 scores (``model_store.QuantRecord``).

The rows are read back from the staged version's own shard files by ``training.offline``'s loader,
which decodes them with the function serving uses (``model_store.quant.dequantize``): what is
measured is what is served. ``model_store.releases.validate`` refuses the version when the AUC
falls more than ``--max-quant-auc-drop`` below the float32 one.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import nn

import model_store
from features.batch import CompactBatch
from features.schema import Schema
from features.transform import dense_matrix
from training.evaluate import EvalResult, auc_logloss, sigmoid


def check_quantized(
    vdir: Path, dtype: str, num_shards: int, schema: Schema, model: nn.Module,
    batches: Iterable[CompactBatch], evaluation: EvalResult,
) -> tuple[model_store.QuantRecord, np.ndarray]:  # fmt: skip
    """Score ``batches`` (the test split, in ``evaluation``'s order) with the dense ``model`` over the
    shards staged in ``vdir`` and compare with ``evaluation`` (the float32 scores); returns the
    record and the scores."""
    from serving.worker.core import EmbeddingWorker, InProcessShard
    from training.offline import open_stores

    stores = open_stores(vdir, num_shards, schema.fingerprint, vdir.name)
    worker = EmbeddingWorker([InProcessShard(s) for s in stores], schema)
    was_training = model.training
    model.eval()
    logits = []
    try:
        with torch.no_grad():
            for b in batches:
                pooled = torch.from_numpy(np.ascontiguousarray(worker.forward(b).pooled, np.float32))
                dense = torch.from_numpy(np.ascontiguousarray(dense_matrix(b, schema), np.float32))
                logits.append(model(pooled, dense).numpy())
    finally:
        model.train(was_training)
        worker.close()
    scores = sigmoid(np.concatenate(logits)) if logits else np.empty(0, np.float32)
    if len(scores) != len(evaluation.scores):
        raise ValueError(f"the test split gave {len(scores)} rows, the evaluation {len(evaluation.scores)}")
    auc, _ = auc_logloss(evaluation.labels, scores)
    diff = float(np.abs(scores - evaluation.scores).max()) if len(scores) else 0.0
    return model_store.QuantRecord(dtype, evaluation.auc, auc, diff, len(scores)), scores
