"""Where a scoring process runs its dense model (``--device``) and with which runtime.

``cpu`` (the default) serves a CPU runtime: ``--runtime auto`` the one the version's export measured
faster (``model_store.dense.runtime_of``). ``cuda`` serves a CUDA runtime (``torchscript-cuda``,
``cuda-graphs``); ``auto`` is ``cuda`` where torch sees a CUDA device and ``cpu`` (saying so)
where it does not. Where the choice includes a GPU, ``--runtime auto`` is decided on the serving
host: every runtime the device allows and the version ships is timed on a warm request-sized batch
(``TIMED_ROWS``), and the fastest serves (``fastest``). ``cuda`` without CUDA is refused with an
error naming it, never served on the CPU instead; so is a runtime of another device than the one
asked for.

The choice is plain code over a ``cuda`` flag and a timing function, so every branch is tested on a
CPU host; torch is imported only to ask whether CUDA is there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from model_store import runtimes
from model_store.dense import AUTO, TIMED_ROWS, check_runtime, runtime_of, time_runtimes

if TYPE_CHECKING:
    from model_store.manifest import VersionManifest

log = logging.getLogger("recserve.dense")

CPU, CUDA = "cpu", "cuda"
DEVICES = (CPU, CUDA, AUTO)
"""What ``--device`` accepts."""
NO_CUDA = "torch sees no CUDA device (a CPU-only torch, no driver, or CUDA_VISIBLE_DEVICES hides them)"

Timer = Callable[[dict[str, Path], Any, Any, int], dict[str, float]]
"""``timer(paths by runtime, pooled, dense, threads)`` -> median ms per runtime (``time_runtimes``)."""


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def check_device(device: str, runtime: str = AUTO, cuda: bool | None = None) -> None:
    """ValueError naming the problem: an unknown device or runtime; a runtime of another device
    than ``device``; ``cuda`` (asked for, or a CUDA runtime's) where CUDA is absent. ``cuda``:
    whether CUDA is there (None: ask torch, only when the answer matters)."""
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
    check_runtime(runtime)
    wanted = runtimes.get(runtime).device if runtime != AUTO else device
    if runtime != AUTO and device != AUTO and wanted != device:
        raise ValueError(f"--runtime {runtime} runs on {wanted}, not on --device {device}")
    if wanted == CUDA and not (cuda_available() if cuda is None else cuda):
        what = f"--runtime {runtime}" if runtime != AUTO else "--device cuda"
        raise ValueError(f"{what}: {NO_CUDA}; serve on the CPU with --device cpu (or auto)")


def fastest(timings_ms: dict[str, float]) -> str:
    """The runtime of the least time (the first registered among equals)."""
    if not timings_ms:
        raise ValueError("no runtime was timed")
    return min(timings_ms, key=timings_ms.__getitem__)


@dataclass(frozen=True)
class DenseChoice:
    """The dense runtime a scorer serves, where, and why."""

    runtime: str
    device: str
    """cpu or cuda (``auto`` resolved)."""
    why: str
    """One line for the log: how it was chosen."""
    timings_ms: dict[str, float] = field(default_factory=dict)
    """Median ms per runtime timed on this host (empty when nothing was timed)."""

    @property
    def source(self) -> str:
        """The runtime whose file it loads (the manifest's ``dense`` key)."""
        return runtimes.get(self.runtime).source


def choose(
    manifest: VersionManifest,
    vdir: Path,
    device: str = CPU,
    runtime: str = AUTO,
    threads: int = 1,
    cuda: bool | None = None,
    timer: Timer = time_runtimes,
) -> DenseChoice:
    """The runtime and device to serve ``manifest``'s version with (module docstring). ValueError
    for what ``check_device`` refuses, or a runtime whose file the version does not ship."""
    cuda = cuda_available() if cuda is None else cuda
    check_device(device, runtime, cuda)
    if runtime != AUTO:
        chosen = runtimes.get(runtime)
        runtime_of(manifest, chosen.source)  # the version ships its file
        return DenseChoice(runtime, chosen.device, f"--runtime {runtime}")
    if device == AUTO and not cuda:
        name = runtime_of(manifest)
        return DenseChoice(name, CPU, f"--device auto: {NO_CUDA}; the export's measured choice")
    if device == CPU:
        return DenseChoice(runtime_of(manifest), CPU, "the export's measured choice")
    pool = {
        r.name: vdir / manifest.dense[r.source]
        for r in runtimes.RUNTIMES.values()
        if (device == AUTO or r.device == device) and r.source in manifest.dense
    }
    if not pool:
        raise ValueError(
            f"this version ships no dense model that runs on {device} (it has {sorted(manifest.dense)})"
        )
    timings = timer(pool, *timing_batch(manifest), threads)
    name = fastest(timings)
    how = ", ".join(f"{k} {v:.3f} ms" for k, v in timings.items())
    return DenseChoice(
        name, runtimes.get(name).device, f"fastest on this host ({how}; {TIMED_ROWS} rows)", timings
    )


def timing_batch(manifest: VersionManifest, rows: int = TIMED_ROWS) -> tuple[np.ndarray, np.ndarray]:
    """A request-sized batch of the version's input shapes (normal noise: no all-zero fast path)."""
    if manifest.num_slots is None or manifest.num_dense is None:
        raise ValueError("this version records no input shapes (model_config): give --runtime to serve it")
    rng = np.random.default_rng(0)
    pooled = rng.standard_normal((rows, manifest.num_slots, manifest.dim), dtype=np.float32)
    return pooled, rng.standard_normal((rows, manifest.num_dense), dtype=np.float32)
