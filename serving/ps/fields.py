"""The attributes ``EmbeddingStore`` (store.py) defines and its mixins (``StoreMemory`` in
growth.py, ``ShardPersistence`` in persistence.py) use: declarations only, for the type checker.
Nothing here runs; the store's ``__init__`` and ``StoreMemory._install_arrays`` set them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
from numpy.typing import NDArray

from serving.ps.config import StoreConfig

__all__ = ["StoreFields"]


class StoreFields:
    """What every part of ``EmbeddingStore`` may read: config, lock, arrays, counters."""

    config: StoreConfig
    clock: Callable[[], float]
    capacity: int
    _lock: threading.RLock

    # the arrays (``StoreMemory._allocate``), dense: slots 0..rows-1 are occupied
    _table: NDArray[np.int32]
    _keys: NDArray[np.uint64]
    _rows: NDArray[np.floating[Any]]  # float32 or float16 (config.dtype)
    _state: dict[str, NDArray[np.float32]]
    _stamp: NDArray[np.uint32]
    _count: NDArray[np.uint32]
    _dirty: NDArray[np.bool_]
    _bits: int
    _sketch: NDArray[np.uint16] | None
    _deleted: list[NDArray[np.uint64]]

    rows: int
    version: str
    delta_seq: int
    step: int
    hits: int
    misses: int
    evictions: int
    expired: int
    inserts: int
    grows: int

    if TYPE_CHECKING:  # defined by StoreMemory (_grow) and EmbeddingStore (_insert, _remove)

        def _grow(self, need: int, keep: int, double: bool = True) -> None: ...

        def _insert(self, new: NDArray[np.uint64], protect: NDArray[np.intp]) -> None: ...

        def _remove(self, victims: NDArray[np.intp]) -> None: ...
