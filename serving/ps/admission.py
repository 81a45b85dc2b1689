"""Admission of new signs (``TableShardConfig.min_count``): a count-min sketch of how often each
unseen sign was asked for, so a sign gets a row only once it has been seen that many times."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from serving.ps import index

__all__ = ["Admission", "sketch_width"]


def sketch_width(cap: int) -> int:
    """Columns of the admission sketch for ``cap`` rows (a power of two)."""
    return 1 << max(10, (cap - 1).bit_length())


class Admission:
    """The sketch (4 x ``sketch_width`` uint16, saturating) and the threshold."""

    def __init__(self, min_count: int, capacity: int):
        self.min_count = min_count
        self.sketch = np.zeros((4, sketch_width(capacity)), dtype=np.uint16)

    @property
    def nbytes(self) -> int:
        return self.sketch.nbytes

    def admit(self, new: NDArray[np.uint64], counts: np.ndarray) -> NDArray[np.uint64]:
        """Count ``counts`` more sightings of the distinct unseen signs ``new``; those now seen
        ``min_count`` times."""
        seen = index.sketch_add(self.sketch, new, counts.astype(np.int64))
        return new[seen >= self.min_count]

    def widened(self, capacity: int) -> np.ndarray:
        """The sketch for a store grown to ``capacity``, not installed (``install``): cell j of a
        wider sketch covers the signs of old cell j % width, so estimates stay >= true counts
        (never under-admit) and get sharper from here on."""
        width = self.sketch.shape[1]
        if sketch_width(capacity) <= width:
            return self.sketch
        return np.tile(self.sketch, (1, sketch_width(capacity) // width))

    def install(self, sketch: np.ndarray) -> None:
        self.sketch = sketch
