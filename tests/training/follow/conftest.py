"""Fixtures the streaming trainer's tests share: ``follow_version``, a store with one small Criteo
version published, trained once per session; ``store``, a test's own copy of it; ``new_topic``, a
topic of the session's mock Kafka cluster (``kafka``, tests/conftest.py) with its dead-letter topic."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.training.follow.helpers import NAME


@pytest.fixture(scope="session")
def follow_version(tmp_path_factory) -> Path:
    """The store root (``<root>/criteo``) of version 1 of the Criteo model: one epoch on the first
    2,000 rows of its split (in-process PS), published. Never written to: tests follow a copy."""
    from training.config import TrainConfig
    from training.train import train

    tmp = tmp_path_factory.mktemp("follow-version")
    cfg = TrainConfig(store=str(tmp / "store"), model=NAME, epochs=1, limit=2000, inprocess_ps=True, publish=True,
                      progress=False, curve=str(tmp / "c.svg"))  # fmt: skip
    train(cfg)
    return tmp / "store"


@pytest.fixture
def store(follow_version, tmp_path) -> Path:
    """This test's copy of ``follow_version``: a store to follow, publish into, retain."""
    out = tmp_path / "store"
    shutil.copytree(follow_version, out)
    return out


@pytest.fixture
def new_topic(kafka):
    """``new_topic(name, partitions=2)``: creates ``name`` on the session's mock cluster and its
    dead-letter topic ``name.dead`` (one partition) beside it; returns ``name``."""

    def create(name: str, partitions: int = 2) -> str:
        kafka.create_topic(name + ".dead", 1)
        return kafka.create_topic(name, partitions)

    return create
