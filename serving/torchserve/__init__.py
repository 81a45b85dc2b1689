"""TorchServe on loopback: config (``config``), the process (``process``), the management and
inference APIs (``api``) and the model archive (``archive``)."""

from serving.torchserve.api import InferenceClient, ManagementClient, TorchServeError
from serving.torchserve.archive import archive
from serving.torchserve.config import TorchServeConfig, write_config, write_log_config
from serving.torchserve.process import TorchServe

__all__ = [
    "InferenceClient", "ManagementClient", "TorchServe", "TorchServeConfig", "TorchServeError", "archive",
    "write_config", "write_log_config",
]  # fmt: skip
