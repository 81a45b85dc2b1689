"""The embedding parameter server: store (``store``), dumps (``persist``), gRPC service
(``server``) and client (``client``).

``EmbeddingStore`` (the training store: compiled kernels, numba) is imported on first use, so a
serving shard -- ``recserve ps --follow``, numpy only -- never loads numba."""

from model_store.shards import StoreError
from serving.ps.config import StoreConfig
from serving.ps.optim import OptimizerConfig

__all__ = ["EmbeddingStore", "OptimizerConfig", "StoreConfig", "StoreError"]


def __getattr__(name: str):
    if name == "EmbeddingStore":
        from serving.ps.store import EmbeddingStore

        return EmbeddingStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
