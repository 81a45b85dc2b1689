"""The embedding parameter server. Training store: ``store`` (``EmbeddingStore``, with its
collaborators in ``arrays``, ``growth``, ``admission``, ``eviction`` and ``persistence``, the
optimizers of ``optim`` with their fast paths in ``fused``, the compiled kernels of ``index``);
serving store: ``mapped`` (``MappedStore`` over ``table``'s ``BucketTable``), kept current by ``follow``;
``deltas`` writes deltas from outside a run; gRPC service: ``server`` (``metrics``), client:
``client``.

``EmbeddingStore`` (compiled kernels, numba) is imported on first use, so a serving shard --
``recserve ps-serve``, numpy only -- never loads numba."""

from serving.ps.config import StoreConfig
from serving.ps.optim import OptimizerSpec

__all__ = ["EmbeddingStore", "OptimizerSpec", "StoreConfig"]


def __getattr__(name: str):
    if name == "EmbeddingStore":
        from serving.ps.store import EmbeddingStore

        return EmbeddingStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
