"""Fixtures every test package may use: ``network``, hosts made of Linux network namespaces;
``readme_ports``, the README's fixed ports held by one test at a time; ``trained``, a store with a
trained, published Criteo version (``trained_copy``: trained once a session, copied); ``kafka``,
the session's mock Kafka cluster. And the order the suite's modules run in (``tests/ordering.py``:
longest first, by their last durations)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from loadtest import mockbroker, netns
from tests.helpers import exclusive, train_version
from tests.ordering import Ordering

if TYPE_CHECKING:
    from training.train import TrainResult


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(Ordering(config), "recserve-ordering")


@pytest.fixture
def network():
    """``network(n, hostnames=None, subnet="")`` -> a ``loadtest.netns.Network`` of n hosts (namespaces on a
    bridge, addresses in 198.18.0.0/15), deleted after the test, also when it fails. Skips with the
    reason where namespaces cannot be made (not root)."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"multi-host test: {reason}")
    with contextlib.ExitStack() as stack:

        def make(n: int, hostnames: list[str] | None = None, subnet: str = "") -> netns.Network:
            return stack.enter_context(netns.Network(n, hostnames, subnet))

        yield make


@pytest.fixture
def readme_ports():
    """The README's fixed ports (8080-8082 and 50061-50071) for this test alone: tests that run its
    lines as printed take them in turn (``exclusive``)."""
    with exclusive("readme-ports"):
        yield


@pytest.fixture(scope="session")
def trained_copy(tmp_path_factory) -> Callable[[Path], TrainResult]:
    """``trained_copy(root)``: what ``train_version(root, seed=0, publish=True)`` makes (the
    Criteo model trained on its bundled split, in-process PS, one epoch; version 1 exported and
    published), copied into ``root`` (absent or empty) from the one store the session trained first;
    its training result, with its paths in ``root``. The xdist workers of a session share that
    store (their base temp dir's parent, made under an flock there): seed 0 trains the same model
    each time, and it was trained once per module (21 in the slow suite) and per bench smoke run
    that imported torch for it alone (a training is 1.3 s in a warm process, 7 s in a fresh one)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if "PYTEST_XDIST_WORKER" in os.environ else base
    first, done = shared / "trained-seed-0", shared / "trained-seed-0.pkl"

    def copy(root: Path) -> TrainResult:
        with open(shared / "trained-seed-0.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released as it closes
            if not done.exists():
                shutil.rmtree(first, ignore_errors=True)  # a session stopped while it trained
                part = done.with_suffix(".part")
                part.write_bytes(pickle.dumps(train_version(first, seed=0, publish=True)))
                part.rename(done)  # whole, or absent
        result = pickle.loads(done.read_bytes())
        shutil.copytree(first, root, dirs_exist_ok=True)
        here = {
            k: str(root / Path(v).relative_to(first))
            for k in ("version_dir", "curve")
            if (v := getattr(result, k))
        }
        return dataclasses.replace(result, **here)

    return copy


@pytest.fixture(scope="module")
def trained(tmp_path_factory, trained_copy):
    """(store root, training result): ``trained_copy``'s store, one per test module."""
    root = tmp_path_factory.mktemp("store")
    return root, trained_copy(root)


@pytest.fixture(scope="session")
def kafka():
    """One mock Kafka cluster (``loadtest.mockbroker``, a child process) for the session's stream
    tests; each test creates its own topics (``kafka.create_topic``)."""
    with mockbroker.running() as broker:
        yield broker
