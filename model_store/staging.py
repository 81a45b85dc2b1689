"""Feeding the dense model on a GPU: batch-size buckets and a pinned staging buffer per bucket.

The device-independent half of the CUDA runtimes (``model_store.runtimes.torchscript_cuda``),
plain code that runs, and is tested, on the CPU:

- ``Buckets``: a CUDA graph replays one fixed shape, so a batch runs in chunks, each padded up to
  the smallest bucket that holds it (a batch above the largest bucket: full chunks of the largest,
  then the rest in its own bucket); the model's output is sliced back to the chunk's rows.
- ``Staging``: per bucket, one host buffer of ``(bucket, slots * dim + num_dense)`` float32, made
  once and reused, into which a chunk's pooled rows and dense features are packed side by side so
  they reach the GPU in ONE copy. It is pinned (page-locked: the copy is a DMA that can overlap)
  only where CUDA is available: pinning needs a CUDA driver. ``unpack`` is the inverse view, what
  the model wrapper runs on the device.

Padding rows keep whatever the buffer last held (zeros at first): every row is scored on its own
(the dense network has no cross-row op in eval mode), and the pad rows' outputs are sliced off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

if TYPE_CHECKING:
    import torch

BUCKETS = (64, 256, 1024, 2048)
"""Batch sizes a CUDA graph is captured for: a ranking request (200 items) pads to 256, a full
micro-batch of ``recserve serve`` (``--batch-max-items`` 2,048) fits the largest."""


@dataclass(frozen=True)
class BucketRun:
    """Rows ``[start, stop)`` of a batch, run in bucket ``bucket`` (>= stop - start)."""

    start: int
    stop: int
    bucket: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Buckets:
    """The batch sizes a model runs at, ascending."""

    sizes: tuple[int, ...] = BUCKETS

    def __post_init__(self) -> None:
        if not self.sizes or any(s < 1 for s in self.sizes) or list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"buckets must be distinct positive sizes in ascending order, got {self.sizes}")

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def of(self, rows: int) -> int:
        """The smallest bucket that holds ``rows`` (1 <= rows <= the largest bucket)."""
        if not 1 <= rows <= self.largest:
            raise ValueError(f"a chunk of {rows} rows: buckets hold 1 to {self.largest}")
        return self.sizes[int(np.searchsorted(self.sizes, rows))]

    def chunks(self, rows: int) -> list[BucketRun]:
        """How a batch of ``rows`` runs: full chunks of the largest bucket, then the rest in the
        smallest bucket that holds it (no chunk for 0 rows)."""
        if rows < 0:
            raise ValueError(f"a batch of {rows} rows")
        full, rest = divmod(rows, self.largest)
        out = [BucketRun(i * self.largest, (i + 1) * self.largest, self.largest) for i in range(full)]
        if rest:
            out.append(BucketRun(full * self.largest, rows, self.of(rest)))
        return out


def unpack(packed: torch.Tensor, slots: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pooled (B, slots, dim), dense (B, rest)) of a packed (B, slots * dim + num_dense) tensor,
    on whatever device it lies (the dense part made contiguous: the model's first Linear reads it)."""
    width = slots * dim
    return packed[:, :width].reshape(-1, slots, dim), packed[:, width:].contiguous()


class Staging:
    """One reused host buffer per bucket, packing pooled rows and dense features for one copy."""

    def __init__(self, slots: int, dim: int, num_dense: int, pin: bool | None = None):
        """``pin``: page-locked buffers (None: where CUDA is available; True without CUDA fails
        in torch, naming it)."""
        import torch

        self.slots, self.dim, self.num_dense = slots, dim, num_dense
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.buffers: dict[int, torch.Tensor] = {}
        """bucket -> its (bucket, width) float32 buffer, made at its first use."""

    @property
    def width(self) -> int:
        return self.slots * self.dim + self.num_dense

    def buffer(self, bucket: int) -> torch.Tensor:
        """The bucket's buffer (made, zeroed, on first use; the same tensor every time after)."""
        buf = self.buffers.get(bucket)
        if buf is None:
            import torch

            buf = torch.zeros((bucket, self.width), dtype=torch.float32, pin_memory=self.pin)
            self.buffers[bucket] = buf
        return buf

    def fill(self, pooled: NDArray[np.float32], dense: NDArray[np.float32], chunk: BucketRun) -> torch.Tensor:
        """The chunk's rows of (pooled (B, slots, dim), dense (B, num_dense)) packed into its
        bucket's buffer, rows ``[0, chunk.rows)``; the buffer is returned whole (bucket rows)."""
        buf = self.buffer(chunk.bucket)
        host = buf.numpy()
        width, n = self.slots * self.dim, chunk.rows
        host[:n, :width] = pooled[chunk.start : chunk.stop].reshape(n, width)
        host[:n, width:] = dense[chunk.start : chunk.stop]
        return buf


Forward = Callable[["torch.Tensor", BucketRun], "torch.Tensor"]
"""``forward(buffer, chunk)``: logits (>= chunk.rows,) of a chunk's filled bucket buffer, on any
device (its first ``chunk.rows`` are the chunk's)."""


def run_chunks(
    pooled: NDArray[np.float32],
    dense: NDArray[np.float32],
    buckets: Buckets,
    staging: Staging,
    forward: Forward,
) -> NDArray[np.float32]:
    """Logits (B,) of a batch run chunk by chunk through ``forward``: each chunk staged in its
    bucket's buffer (padded up to the bucket), its output sliced back to its rows and copied to
    the host. The copy back waits for the device, so the buffer is free for the next chunk."""
    out = np.empty(len(pooled), dtype=np.float32)
    for chunk in buckets.chunks(len(pooled)):
        logits = forward(staging.fill(pooled, dense, chunk), chunk)
        out[chunk.start : chunk.stop] = logits[: chunk.rows].cpu().numpy()
    return out
