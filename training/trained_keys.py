"""The keys of the samples a streaming trainer has trained, over a bounded window: what makes a
sample that the joiner emits twice (it is at least once) train once.

A key is a sample's (request, item) as bytes (``serving.stream.sample_batch``). The set keeps the
keys whose sample time is within ``window_s`` of the newest trained (the join window plus the
longest replay a restarted joiner does), so it stays bounded by the rate times the window. Sorted
numpy arrays: membership of a whole batch is one ``np.isin``, no loop per sample. It is saved
with the offsets in every delta (``model_store.deltas``) and read back on restart.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray


class TrainedKeys:
    """Sorted keys (``keys``, times ``ts``) plus the keys added since the last merge (``_new``):
    a batch is looked up by binary search, O(batch x log(set)), and merged into the sorted arrays
    once the additions reach a sixteenth of them (amortised, no full sort per step)."""

    MERGE_MIN = 4096

    def __init__(self, window_s: float, keys: NDArray[np.bytes_] | None = None,
                 ts: NDArray[np.float64] | None = None) -> None:  # fmt: skip
        if window_s <= 0:
            raise ValueError(f"the dedupe window must be > 0 s, got {window_s}")
        self.window_s = window_s
        self.keys: NDArray[np.bytes_] = np.zeros(0, "S1") if keys is None else keys
        self.ts: NDArray[np.float64] = np.zeros(0, np.float64) if ts is None else ts
        order = np.argsort(self.keys, kind="stable")
        self.keys, self.ts = self.keys[order], self.ts[order]
        self.newest = float(self.ts.max(initial=-np.inf))
        self._new: list[tuple[NDArray[np.bytes_], NDArray[np.float64]]] = []
        self._pending = 0

    def __len__(self) -> int:
        self._merge()
        return len(self.keys)

    def new(self, keys: NDArray[np.bytes_]) -> NDArray[np.bool_]:
        """Per key, whether it is neither in the set nor an earlier key of ``keys`` itself."""
        if keys.dtype.itemsize > self.keys.dtype.itemsize:  # a longer request id: widen once
            self.keys = self.keys.astype(keys.dtype)
        probe = keys.astype(self.keys.dtype)
        at = np.searchsorted(self.keys, probe).clip(max=max(len(self.keys) - 1, 0))
        fresh = (self.keys[at] != probe) if len(self.keys) else np.ones(len(keys), bool)
        if self._new:
            fresh &= ~np.isin(keys, np.concatenate([k for k, _ in self._new]))
        _, first = np.unique(keys, return_index=True)
        once = np.zeros(len(keys), bool)
        once[first] = True
        return fresh & once

    def add(self, keys: NDArray[np.bytes_], ts: NDArray[np.float64]) -> None:
        """Remember trained ``keys`` (new ones: see ``new``); forget those out of the window."""
        if not len(keys):
            return
        self.newest = max(self.newest, float(ts.max()))
        self._new.append((keys, ts))
        self._pending += len(keys)
        if self._pending >= max(self.MERGE_MIN, len(self.keys) // 16):
            self._merge()

    def arrays(self) -> tuple[NDArray[np.bytes_], NDArray[np.float64]]:
        """Every key in the window, sorted, with its time."""
        self._merge()
        return self.keys, self.ts

    def _merge(self) -> None:
        if not self._new:
            return
        all_keys = np.concatenate([self.keys, *(k for k, _ in self._new)])
        all_ts = np.concatenate([self.ts, *(t for _, t in self._new)])
        self._new, self._pending = [], 0
        keep = all_ts >= self.newest - self.window_s
        order = np.argsort(all_keys[keep], kind="stable")
        self.keys, self.ts = all_keys[keep][order], all_ts[keep][order]
