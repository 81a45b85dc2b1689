"""The embedding parameter server. A training shard of a table: ``shard`` (``TableShard``, with
its collaborators in ``arrays``, ``growth``, ``admission``, ``eviction`` and ``persistence``, the
optimizers of ``optim`` with their fast paths in ``fused``, the compiled kernels of ``index``); a
serving shard: ``mapped`` (``MappedTableShard`` over ``table``'s ``BucketTable``), kept current by
``follow``; gRPC service: ``server`` (``metrics``), client: ``client``. "Store" is the model
store only (deltas are cut by ``training.follow.cut``).

``TableShard`` (compiled kernels, numba) is imported on first use, so a serving shard --
``recserve ps-serve``, numpy only -- never loads numba. The names before 0.2 (``EmbeddingStore``,
``StoreConfig``) still work, with a DeprecationWarning (CHANGELOG.md)."""

import sys
import warnings

from serving.ps.config import TableShardConfig
from serving.ps.optim import OptimizerSpec

__all__ = ["OptimizerSpec", "TableShard", "TableShardConfig"]
_FORMER = {"EmbeddingStore": "TableShard", "StoreConfig": "TableShardConfig"}


def __getattr__(name: str):
    if name in _FORMER:
        warnings.warn(
            f"serving.ps.{name} is now serving.ps.{_FORMER[name]}", DeprecationWarning, stacklevel=2
        )
        return getattr(sys.modules[__name__], _FORMER[name])
    if name == "TableShard":
        from serving.ps.shard import TableShard

        return TableShard
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
