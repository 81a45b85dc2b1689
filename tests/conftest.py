"""Fixtures every test package may use: ``network``, hosts made of Linux network namespaces;
``readme_ports``, the README's fixed ports held by one test at a time; ``trained``, a store with a
trained, published Criteo version; ``kafka``, the session's mock Kafka cluster. And the order the
suite's modules run in (``tests/ordering.py``: longest first, by their last durations)."""

from __future__ import annotations

import contextlib

import pytest

from loadtest import mockbroker, netns
from tests.helpers import exclusive, train_version
from tests.ordering import Ordering


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


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(store root, training result): the Criteo model trained on its bundled split (in-process
    PS, one epoch, seed 0), version 1 exported and published. One per test module."""
    root = tmp_path_factory.mktemp("store")
    return root, train_version(root, seed=0, publish=True)


@pytest.fixture(scope="session")
def kafka():
    """One mock Kafka cluster (``loadtest.mockbroker``, a child process) for the session's stream
    tests; each test creates its own topics (``kafka.create_topic``)."""
    with mockbroker.running() as broker:
        yield broker
