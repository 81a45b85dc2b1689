"""What the TorchServe tests share: ``make_config``, a TorchServe on free loopback ports."""

from __future__ import annotations

from pathlib import Path

from serving.torchserve import TorchServeConfig
from tests.helpers import free_ports

PORTS = ("inference_port", "management_port", "metrics_port", "grpc_inference_port", "grpc_management_port")


def make_config(store: Path, run_dir: Path, **overrides) -> TorchServeConfig:
    """A TorchServe serving ``store`` from ``run_dir``, each of its ports a free one."""
    ports = dict(zip(PORTS, free_ports(len(PORTS)), strict=True))
    return TorchServeConfig(model_store=store, run_dir=run_dir, **ports, **overrides)
