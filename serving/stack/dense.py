"""The dense-model switch of the local stack: register a dense version in TorchServe (its
archive from ``serving.stack.packaging``), wait until its workers are READY, make it the default
(``state.dense_version``), retire the one it replaced. ``LocalStack`` uses it at start and after a
TorchServe restart, the controller on every new CURRENT."""

from __future__ import annotations

import time
from pathlib import Path

from serving.stack.config import StackConfig
from serving.stack.packaging import build_mar
from serving.stack.state import StackState


class DenseSwitch:
    """TorchServe's dense versions of one stack (``state`` is the stack's, updated in place:
    the caller saves ``dense_version``)."""

    def __init__(self, cfg: StackConfig, state: StackState, run_dir: Path):
        self.cfg, self.state, self.run_dir = cfg, state, run_dir

    def register(self, vdir: Path, version: str, make_default: bool, timeout_s: float = 180.0) -> None:
        """Register a dense version and wait until its workers are READY (then make it the default).

        Registration is asynchronous on purpose: TorchServe serves a synchronous register on one of
        its netty event-loop threads, and every inference connection on that thread stalls until
        the new workers are up (seconds). Asynchronous registration plus polling keeps serving."""
        from serving.torchserve.ready import not_ready

        mgmt = self.management()
        mgmt.register(
            build_mar(self.cfg, self.state, self.run_dir, vdir, version), self.cfg.model, synchronous=False
        )
        deadline = time.monotonic() + timeout_s
        while (why := not_ready(mgmt, self.cfg.model, version)) is not None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.cfg.model} version {version}: not READY after {timeout_s}s: {why}")
            time.sleep(0.1)
        if make_default:
            mgmt.set_default(self.cfg.model, version)
            self.state.dense_version = version

    def retire(self, version: str) -> None:
        """Unregister a replaced version (asynchronously, as ``register`` explains)."""
        self.management().unregister(self.cfg.model, version, synchronous=False)

    def management(self):
        from serving.torchserve import ManagementClient

        return ManagementClient(
            self.state.management, Path(self.state.key_file) if self.state.key_file else None
        )

    def inference(self):
        from serving.torchserve import InferenceClient

        return InferenceClient(
            self.state.inference, Path(self.state.key_file) if self.state.key_file else None
        )
