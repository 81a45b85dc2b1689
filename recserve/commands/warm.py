"""``recserve warm``: compile the kernels ``recserve train`` and ``recserve serve`` compile at their
start into numba's cache, so that a role started later from the same installation loads them
instead (a frontend's start goes from about 25 s to 2-3 s).

numba keeps a kernel it compiled under ``$NUMBA_CACHE_DIR`` when that is set, else beside its
module (``__pycache__``) when that is writable, else in ``~/.cache/numba``, keyed by the module's
source, numba's and Python's versions and the CPU: its model and features, or ``generic`` with
``NUMBA_CPU_NAME=generic`` (code every x86-64 host runs, which the image uses: it is built on one
host and run on others). A role finds the cache only where it looks itself, under the same
variables, and only where it may write (numba checks before it reads).

warm trains a model on ``--data`` (one epoch) into a temporary store as ``recserve train`` does
at its defaults (the reader, the transform, the training step), then loads a scorer over it with
co-located lookups, whose warm-up decodes a request of each form, looks its rows up in the mapped
shards and runs the dense model (what ``recserve serve`` runs before it takes a connection), and
decodes a few of the rows as the sample records ``recserve join`` writes into their batch (what
``recserve train --stream`` runs at its first consume). The store is removed.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from training.config import TrainConfig

log = logging.getLogger("recserve.warm")


@dataclass
class WarmConfig:
    """``recserve warm``."""

    data: str = TrainConfig.data
    """Rows to train the throwaway model on (the bundled Criteo split: run from the checkout, or
    /app in the image)."""
    schema: str = TrainConfig.schema
    """Feature schema of those rows (the kernels a serving process compiles are those its schema's
    slot kinds need)."""
    test: str = TrainConfig.test
    """Rows the training evaluates on."""


def run(config: WarmConfig) -> int:
    import model_store as ms
    from serving.scoring.config import ScoringConfig
    from serving.scoring.core import Scorer
    from training.train import train

    started = time.monotonic()
    store = Path(tempfile.mkdtemp(prefix="recserve-warm-"))
    try:
        train(TrainConfig(store=str(store), model="warm", schema=config.schema, data=config.data,
                          test=config.test, epochs=1, publish=True, progress=False))  # fmt: skip
        version = ms.current(store, "warm") or ""
        Scorer(ScoringConfig(str(ms.version_dir(store, "warm", version)), lookups="colocated")).close()
        _stream_samples(config)
    finally:
        shutil.rmtree(store, ignore_errors=True)
    where = os.environ.get("NUMBA_CACHE_DIR") or "beside the modules (__pycache__), else ~/.cache/numba"
    cpu = os.environ.get("NUMBA_CPU_NAME") or "this host's CPU"
    log.info("numba's cache is warm in %.1f s: %s (code for %s)", time.monotonic() - started, where, cpu)
    return 0


def _stream_samples(config: WarmConfig) -> None:
    """A few of ``config.data``'s rows as sample records, decoded and batched as the streaming
    trainer's reading thread does (``stream.sample_batch.read_fitting``, ``to_batches``)."""
    import numpy as np

    from features import stream
    from features.schema import load_schema
    from features.transform import transform
    from stream.records import Impression, SampleWriter, Versions
    from stream.rows import RowTable
    from stream.sample_batch import read_fitting, to_batches

    schema = load_schema(config.schema)
    batch = transform(stream.read(config.data, schema, limit=8), schema)
    served = Impression("warm", 0.0, Versions("warm", 0, "warm"), np.zeros(batch.num_rows, np.float32), b"")
    writer = SampleWriter(served, RowTable.of(batch))
    samples, _ = read_fitting([writer.encode(i, 0.0) for i in range(batch.num_rows)], schema)
    to_batches(samples, np.array([0, samples.num_rows]), schema)


CONFIG = WarmConfig
