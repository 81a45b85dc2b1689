"""The keys of the samples a streaming trainer has trained, over a bounded window: what makes a
sample that the joiner emits twice (it is at least once) train once.

A key is a sample's (request, item, kind) as bytes (``stream.sample_batch``). The set keeps the
keys whose sample time is within ``window_s`` of the newest trained (the join window plus the
longest replay a restarted joiner does), so it stays bounded by the rate times the window. Sorted
numpy arrays: membership of a whole batch is one ``np.isin``, no loop per sample. It is saved
with the offsets in every delta (``model_store.deltas``) and read back on restart. A key may carry
a value (``add(..., values)``, ``find``): ``training.follow.final_labels`` keeps where each negative
lies in the run's progressive record that way.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray


class TrainedKeys:
    """Sorted keys (``keys``, times ``ts``) plus the keys added since the last merge, kept sorted
    too (``_pk``, ``_pt``: each batch inserted where it sorts, a copy of the few pending, not a
    sort): a batch is looked up by two binary searches, O(batch x log(set)), and the pending keys
    are merged into the sorted arrays once they reach a sixteenth of them (amortised: no full
    sort per step, nor a set operation over the pending keys, which cost tens of ms a step at a
    million keys)."""

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
        self.values = np.full(len(self.keys), -1, np.int64)
        self._pk, self._pt, self._pv = self.keys[:0], self.ts[:0], self.values[:0]

    def __len__(self) -> int:
        self._merge()
        return len(self.keys)

    @property
    def size(self) -> int:
        """Keys held, those out of the window not dropped yet included (no merge: cheap)."""
        return len(self.keys) + len(self._pk)

    def new(self, keys: NDArray[np.bytes_]) -> NDArray[np.bool_]:
        """Per key, whether it is neither in the set nor an earlier key of ``keys`` itself."""
        probe = keys.astype(self._widen(keys.dtype.itemsize))
        fresh = ~(_member(self.keys, probe) | _member(self._pk, probe))
        _, first = np.unique(keys, return_index=True)
        once = np.zeros(len(keys), bool)
        once[first] = True
        return fresh & once

    def add(
        self, keys: NDArray[np.bytes_], ts: NDArray[np.float64], values: NDArray[np.int64] | None = None
    ) -> None:
        """Remember trained ``keys`` (new ones: see ``new``), each with its value (-1: none);
        forget those out of the window."""
        if not len(keys):
            return
        self.newest = max(self.newest, float(ts.max()))
        k = keys.astype(self._widen(keys.dtype.itemsize))
        order = np.argsort(k, kind="stable")
        # where each new key lands among the pending ones (np.insert's places, found once for all three)
        at = np.searchsorted(self._pk, k[order]) + np.arange(len(k))
        was = np.ones(len(self._pk) + len(k), bool)
        was[at] = False
        v = np.full(len(keys), -1, np.int64) if values is None else values
        self._pk, self._pt, self._pv = (
            _placed(old, new[order], at, was) for old, new in ((self._pk, k), (self._pt, ts), (self._pv, v))
        )
        if len(self._pk) >= max(self.MERGE_MIN, len(self.keys) // 16):
            self._merge()

    def find(self, keys: NDArray[np.bytes_]) -> NDArray[np.int64]:
        """Per key, its value (-1: not held, or held without one)."""
        self._merge()
        probe = keys.astype(self._widen(keys.dtype.itemsize))
        if not len(self.keys):
            return np.full(len(keys), -1, np.int64)
        at = np.searchsorted(self.keys, probe).clip(max=len(self.keys) - 1)
        return np.where(self.keys[at] == probe, self.values[at], -1)

    def arrays(self) -> tuple[NDArray[np.bytes_], NDArray[np.float64]]:
        """Every key in the window, sorted, with its time."""
        self._merge()
        return self.keys, self.ts

    def _widen(self, width: int) -> np.dtype:
        """The keys' dtype, widened once to ``width`` bytes (a longer request id)."""
        if width > self.keys.dtype.itemsize:
            self.keys, self._pk = self.keys.astype(f"S{width}"), self._pk.astype(f"S{width}")
        return self.keys.dtype

    def _merge(self) -> None:
        if not len(self._pk):
            return
        all_keys, all_ts = np.concatenate([self.keys, self._pk]), np.concatenate([self.ts, self._pt])
        all_values = np.concatenate([self.values, self._pv])
        self._pk, self._pt, self._pv = self.keys[:0], self.ts[:0], self.values[:0]
        keep = all_ts >= self.newest - self.window_s
        order = np.argsort(all_keys[keep], kind="stable")  # two sorted runs: merged, not sorted anew
        self.keys, self.ts, self.values = all_keys[keep][order], all_ts[keep][order], all_values[keep][order]


def _member(sorted_keys: NDArray[np.bytes_], probe: NDArray[np.bytes_]) -> NDArray[np.bool_]:
    """Per probe, whether it is in ``sorted_keys`` (of its dtype)."""
    if not len(sorted_keys):
        return np.zeros(len(probe), bool)
    at = np.searchsorted(sorted_keys, probe).clip(max=len(sorted_keys) - 1)
    return np.asarray(sorted_keys[at] == probe)


def _placed(old: NDArray, new: NDArray, at: NDArray[np.int64], was: NDArray[np.bool_]) -> NDArray:
    """``old`` with ``new`` put at positions ``at`` of the result (``was``: the result's positions
    that hold ``old``'s entries, in order)."""
    out = np.empty(len(was), old.dtype)
    out[at] = new
    out[was] = old
    return out
