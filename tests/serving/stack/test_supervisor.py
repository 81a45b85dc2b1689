"""Replicas and supervision on a real stack: `LocalStack` with 2 PS shards x 2 replicas, the worker,
TorchServe, the controller and the supervisor, all real processes on free loopback ports.

Killing a PS replica with SIGKILL while requests are scored fails none of them (the worker retries
the other replica); the supervisor restarts the killed replica, which serves the same version and
delta seq before it says SERVING, and the worker sends it lookups again. A killed worker is
restarted and scoring resumes; so is a killed TorchServe, with the served dense version; `down`
stops the supervisor first and then every process, replacements included."""

from __future__ import annotations

import os
import signal
import threading

import orjson
import pytest

from model_store.releases import publish
from serving.ps.client import PSClient, ShardError
from serving.scoring.client import ScoringClient
from serving.stack.down import down
from serving.stack.state import read_state
from tests.helpers import gone, wait_until
from tests.serving.helpers import make_version

pytestmark = pytest.mark.slow
BODY = orjson.dumps(
    {"context": {"user": "u1"}, "items": [{"item": f"i{k}", "x": k / 200} for k in range(200)]}
)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, start_stack):
    root = tmp_path_factory.mktemp("store")
    publish(root, "m", make_version(root))
    # statuses, not latency: no request may fail while a replica is killed and restarted, and the
    # handler's 1 s default deadline on the worker can expire on a busy 2-core CI box meanwhile
    config = dict(ps_shards=2, replicas=2, disable_token_auth=True, poll_s=0.2, worker_timeout_s=10.0)
    return root, start_stack(root, "m", **config)


@pytest.fixture
def client(stack):
    c = ScoringClient(stack[1].state.endpoint)
    yield c
    c.close()


def _ps_state(address: str) -> tuple[str, int] | None:
    try:
        with PSClient(address, timeout_s=1.0) as ps:
            st = ps.stats()
    except ShardError:
        return None
    return st["version"], st["delta_seq"]


def _publish_delta(root) -> int:
    from training.follow.cut import DeltaWriter

    writer = DeltaWriter(root, "m")
    signs = writer.signs()[:20]
    writer.assign(signs, writer.lookup(signs) + 0.5)
    return writer.publish()[0]


def test_the_stack_runs_two_replicas_per_shard_and_the_worker_gets_them_grouped(stack):
    _, s = stack
    assert [len(r) for r in s.state.ps_shards] == [2, 2]
    assert {"ps0.0", "ps0.1", "ps1.0", "ps1.1", "worker", "controller", "supervisor"} <= set(s.state.pids)
    worker_args = s.state.commands["worker"].args
    assert worker_args[worker_args.index("--ps") + 1] == ",".join("|".join(r) for r in s.state.ps_shards)


def test_killing_a_replica_while_scoring_fails_no_request(stack, client):
    root, s = stack
    results: list[int] = []
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            status, payload = client.post(BODY)
            results.append(status)
            if status != 200:
                print("failed:", status, payload[:300])

    th = threading.Thread(target=loop)
    th.start()
    try:
        wait_until(lambda: len(results) >= 5, 60, "scoring before the kill")
        old = read_state(s.run_dir).pids["ps0.0"]
        os.kill(old, signal.SIGKILL)
        wait_until(lambda: read_state(s.run_dir).pids["ps0.0"] != old, 30, "ps0.0 restarted")
        restarted = len(results)
        wait_until(lambda: len(results) >= restarted + 5, 60, "scoring after the restart")  # through it all
    finally:
        stop.set()
        th.join()
    assert results and all(r == 200 for r in results), f"{results.count(200)} of {len(results)} scored"


def test_a_killed_replica_is_restarted_with_the_same_version_and_delta_and_used_again(stack, client):
    root, s = stack
    seq = _publish_delta(root)
    addresses = s.state.ps_shards[1]
    served = wait_until(lambda: [_ps_state(a) for a in addresses] if all(
        (st := _ps_state(a)) and st[1] == seq for a in addresses) else None, 30, f"delta {seq} live")  # fmt: skip
    state = read_state(s.run_dir)
    old = state.pids["ps1.1"]
    restarts = state.restarts.get("ps1.1", 0)
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: read_state(s.run_dir).pids["ps1.1"] != old, 30, "ps1.1 restarted")
    assert read_state(s.run_dir).restarts["ps1.1"] == restarts + 1
    assert read_state(s.run_dir).last_death["ps1.1"].how
    wait_until(lambda: _ps_state(addresses[1]), 60, "the replacement answers")
    assert _ps_state(addresses[1]) == served[0]  # the version and delta seq its twin serves
    from serving.rpc.health import wait_serving

    wait_serving(addresses[1], 10)
    with PSClient(addresses[1]) as ps:
        looked_up = lambda: (st := ps.stats())["hits"] + st["misses"]  # noqa: E731
        before = looked_up()

        def looked_up_again() -> bool:  # the worker puts it back into its rotation once it is SERVING
            assert client.post(BODY)[0] == 200
            return looked_up() > before

        wait_until(looked_up_again, 30, "lookups sent to the replacement")


def test_a_killed_worker_is_restarted_and_scoring_resumes(stack, client):
    _, s = stack
    old = read_state(s.run_dir).pids["worker"]
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: read_state(s.run_dir).pids["worker"] != old, 30, "worker restarted")
    wait_until(lambda: client.post(BODY)[0] == 200, 60, "scoring again")
    status, payload = client.post(BODY)
    assert status == 200 and len(orjson.loads(payload)["scores"]) == 200


def test_a_killed_torchserve_is_restarted_with_the_served_version_on_the_same_endpoint(stack, client):
    """The JVM killed: the supervisor starts TorchServe again on its ports, registers the dense
    version the stack served as the default, and the same endpoint scores the same again."""
    _, s = stack
    status, before = client.post(BODY)
    assert status == 200
    old = read_state(s.run_dir).pids["torchserve"]
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: read_state(s.run_dir).pids["torchserve"] != old, 120, "torchserve restarted")
    state = read_state(s.run_dir)
    assert state.restarts["torchserve"] == 1 and "unknown" in state.last_death["torchserve"].how
    wait_until(lambda: _post_or_none(client) == 200, 60, "scoring again")
    status, after = client.post(BODY)
    assert status == 200
    assert orjson.loads(after)["scores"] == orjson.loads(before)["scores"]
    assert orjson.loads(after)["versions"]["dense"] == orjson.loads(before)["versions"]["dense"]


def _post_or_none(client) -> int | None:
    try:
        return client.post(BODY)[0]
    except OSError:  # the server is not listening yet
        client.close()
        return None


def test_down_stops_the_supervisor_first_and_every_process_replacements_included(stack):
    _, s = stack
    pids = read_state(s.run_dir).pids
    stopped = down(s.run_dir)
    assert stopped[0] == "supervisor" and sorted(stopped) == sorted(pids)
    wait_until(lambda: all(gone(pid) for pid in pids.values()), 10, f"{sorted(pids)} gone")
    assert not (s.run_dir / "stack.json").exists()
