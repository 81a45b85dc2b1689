"""Fixtures of the stack tests: whole local stacks (`recserve up`'s LocalStack) on loopback."""

from __future__ import annotations

import pytest

from serving.stack.local import LocalStack, StackConfig


@pytest.fixture(scope="module")
def start_stack():
    """``start_stack(root, model, **config)``: a LocalStack over the store at ``root``, every port
    picked free on loopback (``config``: more StackConfig fields), started; every stack started
    so is stopped when the module is done."""
    started: list[LocalStack] = []

    def start(root, model: str, **config) -> LocalStack:
        cfg = StackConfig(
            store=str(root), model=model, http_port=0, management_port=0, metrics_port=0, **config
        )
        started.append(LocalStack(cfg).start())
        return started[-1]

    yield start
    for stack in reversed(started):
        stack.stop()
