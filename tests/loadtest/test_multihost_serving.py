"""Serving survives a lost host: PS replicas on two hosts, two worker hosts, the frontend on a
fifth (``loadtest/multihost_serving.py``); under load, one PS host's link and then one worker
host's link drop every packet for a while. No request fails, none mixes versions, the lost host
leaves the rotation (the logs say so) and rejoins when its link is back."""

from __future__ import annotations

import pytest

from loadtest.multihost_serving import Roles, under_load
from tests.helpers import wait_until

pytestmark = pytest.mark.slow


def test_a_lost_ps_host_and_a_lost_worker_host_cost_no_request(network, tmp_path, trained_copy):
    store = tmp_path / "store"
    trained_copy(store)
    net = network(5, ["ps-a", "ps-b", "worker-c", "worker-d", "serve-e"])
    a, _, c, _, _ = net.hosts
    roles = Roles(net.hosts, store, tmp_path).start()
    try:
        events = [lambda: net.cut(a), lambda: net.restore(a), lambda: net.cut(c), lambda: net.restore(c)]
        figures = under_load(roles, 20, 22, tmp_path / "timeline.txt", events, [4, 9, 13, 18])
        wait_until(lambda: roles.rejoined(a) and roles.rejoined(c), 60, "hosts A and C SERVING again")
    finally:
        roles.stop()
    assert figures["requests"] >= 300, figures
    assert figures["failures"] == 0 and figures["mixed_responses"] == 0, figures
    workers = "".join(log.read_text() for log in tmp_path.glob("worker-*.log"))
    served = (tmp_path / "serve.log").read_text()
    assert f"replica {a.address}:50061: SERVING ->" in workers, workers[-3000:]
    assert f"{c.address}:50071 SERVING ->" in served, served[-3000:]
