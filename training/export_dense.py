"""Export the dense network in every exporting runtime (``model_store.runtimes.EXPORTS``: the
runtimes that run another's export on a GPU write nothing), verify each
export against the torch model, and time them; serving loads one with
``model_store.dense.load_dense``.

Verification: every runtime's export is loaded back and scored on the test rows; an export whose
logits differ from torch's beyond ``atol + rtol * |logit|`` raises ExportVerificationError, so a
version that does not reproduce the trainer's scores is never published.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from model_store import runtimes
from model_store.dense import TIMED_ROWS, time_runtimes
from model_store.manifest import RuntimeChoice
from model_store.runtimes import DenseRuntime, as_array

log = logging.getLogger("recserve.train")

# runtimes other than torch sum in other orders: ~1e-6 apart at ordinary logits, more at |logit|
# >> 1 (FM/DeepFM), hence a relative term too
ATOL, RTOL = 1e-4, 1e-4


class ExportVerificationError(RuntimeError):
    """The exported model does not reproduce the torch model's outputs."""


@dataclass(frozen=True)
class DenseExport:
    """What ``export_dense`` wrote into a version directory, for its manifest."""

    files: dict[str, str]
    """Runtime name -> file relative to the version directory (the manifest's ``dense``)."""
    max_abs_diff: dict[str, float]
    """Runtime name -> max abs difference of its logits from torch's on the test rows."""
    timing: RuntimeChoice
    """The runtimes' p50 on a request-sized batch and the faster one (the manifest's
    ``dense_runtime``: what ``--runtime auto`` serves)."""


def verify(
    runtime: DenseRuntime,
    path: str | os.PathLike[str],
    model: nn.Module,
    pooled: Tensor | np.ndarray,
    dense: Tensor | np.ndarray,
    atol: float = ATOL,
    rtol: float = RTOL,
) -> float:
    """Max abs difference between ``runtime``'s export at ``path`` and torch's logits on these
    inputs; ExportVerificationError where any row differs by more than ``atol + rtol * |logit|``
    (or the shapes differ). Why ``rtol``: float32 carries ~7 digits, so two correct runtimes that
    sum in a different order differ by ~1e-6 at |logit| ~ 10."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    was_training = inner.training
    inner.eval()
    try:
        device = next(iter(inner.parameters())).device
        with torch.no_grad():
            args = (torch.from_numpy(as_array(x)).to(device) for x in (pooled, dense))
            expected = inner(*args).cpu().numpy()
    finally:
        inner.train(was_training)
    got = runtime.load(Path(path), None)(as_array(pooled), as_array(dense))
    name = runtime.name
    if got.shape != expected.shape:
        raise ExportVerificationError(f"{path}: {name} logits shape {got.shape} != torch {expected.shape}")
    err = np.abs(got - expected)
    diff = float(err.max()) if err.size else 0.0
    bad = ~(err <= atol + rtol * np.abs(expected))  # NaN counts as bad
    if bad.any():
        raise ExportVerificationError(
            f"{path}: {name} logits differ from torch by up to {diff:.3g} (max abs); "
            f"{int(bad.sum())} of {err.size} rows exceed atol={atol:g} + rtol={rtol:g} * |logit|"
        )
    return diff


def choose_runtime(vdir: Path, files: dict[str, str], pooled: np.ndarray, dense: np.ndarray) -> RuntimeChoice:
    """Time the version's dense runtimes on a request-sized batch of the test rows (one intra-op
    thread: a scoring process's default) and name the faster one: what ``--runtime auto``
    serves. The manifest keeps the figures beside the choice."""
    reps = -(-TIMED_ROWS // len(pooled))
    p, x = (np.concatenate([a] * reps)[:TIMED_ROWS] for a in (pooled, dense))
    p50 = time_runtimes({name: vdir / rel for name, rel in files.items()}, p, x, num_threads=1)
    default = min(p50, key=p50.__getitem__)
    log.info("dense runtime %s (p50 on %d rows, 1 thread: %s)", default, len(p),
             ", ".join(f"{k} {v:.3f} ms" for k, v in p50.items()))  # fmt: skip
    return RuntimeChoice(default, p50, len(p), threads=1)


def export_dense(
    model: nn.Module, vdir: Path, pooled: np.ndarray, dense: np.ndarray, timed: RuntimeChoice | None = None
) -> DenseExport:
    """Write ``model`` in every exporting runtime (``runtimes.EXPORTS``) under ``vdir``, verify each
    on (pooled, dense) (the test rows) and time them. ``timed``: the choice of a version of the same
    architecture (a full version from the stream: its parent's), kept where it timed these very
    runtimes instead of timing them again: the cost is the network's shape, not its weights, and
    timing on a busy trainer's host picked runtimes by noise, version to version."""
    files, diffs = {}, {}
    for runtime in runtimes.EXPORTS.values():
        path = runtime.write(model, vdir / runtime.file, pooled[:2], dense[:2])
        diffs[runtime.name] = verify(runtime, path, model, pooled, dense)
        files[runtime.name] = runtime.file
    if timed is not None and set(timed.p50_ms) == set(files):
        return DenseExport(files, diffs, timed)
    return DenseExport(files, diffs, choose_runtime(vdir, files, pooled, dense))
