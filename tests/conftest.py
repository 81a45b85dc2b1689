"""Fixtures every test package may use: ``network``, hosts made of Linux network namespaces."""

from __future__ import annotations

import contextlib

import pytest

from loadtest import netns


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
