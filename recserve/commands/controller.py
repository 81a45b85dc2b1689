"""``recserve controller`` (started by ``recserve up``): keeps TorchServe's dense model on the
store's CURRENT version (``serving.stack.controller``)."""

from __future__ import annotations

from serving.stack.controller import ControllerConfig as CONFIG


def run(cfg: CONFIG) -> int:
    from serving.stack.controller import run_controller

    return run_controller(cfg)
