"""The embedding parameter server: store (``store``), dumps (``persist``), gRPC service
(``server``) and client (``client``)."""

from model_store.shards import StoreError
from serving.ps.optim import OptimizerConfig
from serving.ps.store import EmbeddingStore, StoreConfig

__all__ = ["EmbeddingStore", "OptimizerConfig", "StoreConfig", "StoreError"]
