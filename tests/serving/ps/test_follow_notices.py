"""A serving PS shard learns of a delta by its notice (serving/notices/), far sooner than its poll:
announced on Kafka, or seen by inotify; a delta whose notice never came is caught by the poll."""

from __future__ import annotations

import contextlib
import urllib.request

import numpy as np
import pytest

import model_store as ms
from model_store.releases import publish
from serving.notices import LISTENING, NOTICES, announcer
from serving.ps.client import PSClient
from serving.ps.config import ServingShardConfig
from serving.ps.shard import TableShard
from serving.rpc.config import ServerConfig
from tests.helpers import free_port, ps_in_thread, wait_until
from tests.serving.helpers import DIM, SIGNS, make_rows_version
from tests.serving.ps.helpers import store_config

POLL_S = 60.0  # a delta seen within the deadline below came by its notice
DEADLINE_S = 10.0


@pytest.fixture
def model(tmp_path):
    trainer = TableShard(store_config(dim=DIM, capacity=10_000))
    trainer.lookup(SIGNS, insert=True)
    v1 = make_rows_version(tmp_path, trainer)
    publish(tmp_path, "m", v1)
    return tmp_path / "m", trainer, v1


def _cut(model_dir, version: str, trainer: TableShard, spec: str = "") -> int:
    trainer.apply_gradients(SIGNS[:10], np.ones((10, DIM), np.float32))
    seq = trainer.delta_seq + 1
    ddir = ms.delta_dir(model_dir / version, seq)
    trainer.dump_delta(ddir)
    ms.mark_done(ddir)
    a = announcer(spec)
    if a is not None:
        a.announce(_notice(model_dir, version, seq, ddir))
        a.close()
        assert a.failed == 0
    return seq


def _notice(model_dir, version, seq, ddir):
    from serving.notices import Notice

    return Notice(model_dir.name, version, seq, (ddir / ms.SUCCESS).stat().st_mtime)


@contextlib.contextmanager
def _shard(model_dir, notices: str, poll_s: float = POLL_S):
    """A serving shard of model_dir on a thread, once it listens for notices; (client, metrics URL)."""
    metrics = free_port()
    cfg = ServingShardConfig(str(model_dir), dim=DIM, notices=notices, poll_s=poll_s,
                             server=ServerConfig(port=0, metrics_port=metrics, grace_s=0.1))  # fmt: skip
    with ps_in_thread(cfg) as address:
        client = PSClient(address, timeout_s=5.0)
        url = f"http://127.0.0.1:{metrics}/metrics"
        try:
            wait_until(lambda: metric(url, LISTENING) == 1, 30, "the shard listening for notices")
            yield client, url
        finally:
            client.close()


def metric(url: str, name: str, **labels: str) -> float | None:
    """The value of the sample ``name`` {labels...} on the /metrics page at ``url`` (None: none)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    return None


def _applied(client: PSClient, version: str, seq: int):
    return lambda: client.stats()["delta_seq"] == seq and client.stats()["version"] == version


@pytest.mark.slow
def test_a_delta_announced_on_kafka_is_applied_long_before_the_poll(kafka, model):
    model_dir, trainer, v1 = model
    spec = f"kafka://{kafka.bootstrap}/{kafka.create_topic('notices-ps', 1)}"
    with _shard(model_dir, spec) as (client, url):
        assert client.stats()["version"] == v1
        for _ in range(2):
            seq = _cut(model_dir, v1, trainer, spec)
            wait_until(_applied(client, v1, seq), DEADLINE_S, f"delta {seq} applied at its notice")
        assert metric(url, NOTICES, outcome="ok") == 2


@pytest.mark.slow
def test_a_delta_written_on_this_host_is_applied_at_its_inotify_event(model):
    model_dir, trainer, v1 = model
    with _shard(model_dir, "inotify") as (client, _):
        seq = _cut(model_dir, v1, trainer)  # no announcer: the file's rename is the notice
        wait_until(_applied(client, v1, seq), DEADLINE_S, f"delta {seq} applied at its inotify event")


@pytest.mark.slow
def test_a_delta_whose_notice_never_came_is_caught_by_the_poll(kafka, model):
    model_dir, trainer, v1 = model
    spec = f"kafka://{kafka.bootstrap}/{kafka.create_topic('notices-missed', 1)}"
    with _shard(model_dir, spec, poll_s=0.5) as (client, url):
        seq = _cut(model_dir, v1, trainer)  # written, never announced
        wait_until(_applied(client, v1, seq), DEADLINE_S, f"delta {seq} applied by the poll")
        assert metric(url, NOTICES, outcome="ok") == 0


def test_a_follower_wants_only_what_it_does_not_serve_yet(model):
    from serving.notices import VERSION, Notice
    from serving.ps.follow import Follower
    from serving.ps.mapped import MappedTableShard
    from serving.ps.shard import TableShardConfig
    from serving.ps.spec import TableSpec

    model_dir, trainer, v1 = model
    seq = _cut(model_dir, v1, trainer)
    follower = Follower(MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM))), model_dir)
    follower.poll()
    assert follower.store.delta_seq == seq

    def wants(version, s):
        return follower.wants(Notice("m", version, s, 0.0))

    assert not wants(v1, seq) and wants(v1, seq + 1)  # the delta served, the next
    assert not wants(v1, VERSION) and wants("9", VERSION)  # CURRENT moved: to what is served, elsewhere
    assert not wants("9", 0)  # a delta of a version neither served nor CURRENT
    pinned = Follower(MappedTableShard(TableShardConfig(table=TableSpec(dim=DIM))), model_dir, pin=v1)
    assert not pinned.wants(Notice("m", "9", VERSION, 0.0)) and pinned.wants(Notice("m", v1, 0, 0.0))
