"""The TorchScript export run on a GPU: ``torchscript-cuda`` (eager) and ``cuda-graphs``.

Both load ``dense/model.pt`` onto the current CUDA device and feed it the same way
(``model_store.staging``): a batch runs in chunks of at most the largest bucket; a chunk's pooled
rows and dense features are packed into its bucket's pinned host buffer and reach the GPU in one
copy. ``torchscript-cuda`` runs the module on the chunk's rows; ``cuda-graphs`` captures, at load,
one CUDA graph per bucket (``BUCKETS``) over a static input of the bucket's shape, and per chunk
copies into that input (padded up to the bucket), replays the graph and slices the output: one
launch instead of one per kernel, what makes a small network fast on a GPU.

``load`` refuses a host without CUDA, naming it. A loaded model serves one call at a time (its
staging buffers and static inputs are shared): a lock holds the others.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from model_store.runtimes import torchscript as ts
from model_store.runtimes.base import (
    DenseFn,
    DenseRuntime,
    Load,
    as_array,
    check_inputs,
    quiet_deprecations,
)
from model_store.runtimes.registry import register
from model_store.staging import BucketRun, Buckets, Forward, Staging, run_chunks, unpack

if TYPE_CHECKING:
    import torch

WARMUP_RUNS = 5
"""Runs of each bucket's shape before its capture: the TorchScript executor profiles and
optimises a graph over its first runs, and a capture must see the final kernels."""


def cuda_module(path: Path) -> tuple[Any, torch.device, tuple[int, int, int]]:
    """The scripted module on the current CUDA device, that device, and (slots, dim, num_dense)."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError(f"{path}: the CUDA dense runtimes need a CUDA device; torch sees none")
    device = torch.device("cuda", torch.cuda.current_device())
    with quiet_deprecations():
        module = torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]  # unannotated in torch
    module.eval()
    return module, device, (int(module.num_slots), int(module.dim), int(module.num_dense))


def eager_forward(module: Any, device: torch.device, slots: int, dim: int) -> Forward:
    """A chunk's rows copied to ``device`` in one copy (non-blocking: the buffer is pinned) and
    run through the module."""

    def forward(buf: torch.Tensor, chunk: BucketRun) -> torch.Tensor:
        return module(*unpack(buf[: chunk.rows].to(device, non_blocking=True), slots, dim))  # type: ignore[no-any-return]

    return forward


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic GC off while graphs are captured. A collection inside a capture frees
    tensors in the capturing thread, and freeing a pinned or cross-stream block records a CUDA
    event outside the capture. The one bench-gpu run on an H100 (stop 48) aborted so while the lean
    frontend chose its runtime: a ``createEvent`` error in a tensor's destructor on a worker
    thread. That this is the cause is a reading of the trace, not yet checked on a GPU;
    ``torch.cuda.graph`` itself collects once before a capture, not during it."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def graph_forward(module: Any, device: torch.device, staging: Staging, buckets: Buckets) -> Forward:
    """One CUDA graph per bucket, captured now over a static input of the bucket's shape; a
    chunk's bucket buffer is copied into its static input (one copy) and its graph replayed."""
    import torch

    inputs: dict[int, torch.Tensor] = {}
    outputs: dict[int, torch.Tensor] = {}
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # unannotated in torch
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.inference_mode(), torch.cuda.stream(side), gc_paused():
        for bucket in buckets.sizes:
            static = staging.buffer(bucket).to(device)
            for _ in range(WARMUP_RUNS):
                module(*unpack(static, staging.slots, staging.dim))
            graph = torch.cuda.CUDAGraph()
            # thread_local: a version loads beside the one serving, whose thread keeps using the GPU
            with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
                outputs[bucket] = module(*unpack(static, staging.slots, staging.dim))
            inputs[bucket], graphs[bucket] = static, graph
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)

    def forward(buf: torch.Tensor, chunk: BucketRun) -> torch.Tensor:
        inputs[chunk.bucket].copy_(buf, non_blocking=True)
        graphs[chunk.bucket].replay()
        return outputs[chunk.bucket]

    return forward


def _loader(graphs: bool) -> Load:
    def load(path: Path, num_threads: int | None) -> DenseFn:
        import torch

        module, device, shape = cuda_module(path)
        buckets, staging = Buckets(), Staging(*shape)
        run = (
            graph_forward(module, device, staging, buckets)
            if graphs
            else eager_forward(module, device, *shape[:2])
        )
        lock = threading.Lock()

        def predict(pooled: NDArray[Any], dense: NDArray[Any]) -> NDArray[np.float32]:
            p, d = as_array(pooled), as_array(dense)
            check_inputs(p, d, *shape)
            with lock, torch.inference_mode():
                return run_chunks(p, d, buckets, staging, run)

        return predict

    return load


TORCHSCRIPT_CUDA = register(
    DenseRuntime(
        "torchscript-cuda", ts.RUNTIME.file, None, _loader(graphs=False), device="cuda", of=ts.RUNTIME.name
    )
)
CUDA_GRAPHS = register(
    DenseRuntime(
        "cuda-graphs", ts.RUNTIME.file, None, _loader(graphs=True), device="cuda", of=ts.RUNTIME.name
    )
)
