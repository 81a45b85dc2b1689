"""The embedding parameter server: store (``store``), dumps (``persist``), gRPC service
(``server``) and client (``client``)."""

from serving.ps.optim import OptimizerConfig
from serving.ps.persist import StoreError
from serving.ps.store import EmbeddingStore, StoreConfig

__all__ = ["EmbeddingStore", "OptimizerConfig", "StoreConfig", "StoreError"]
