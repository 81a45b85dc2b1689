"""docs/training.md, "Streaming ranks on several hosts", run as printed on two hosts (network
namespaces named host-a and host-b, the store bound at /mnt/recserve on each, the mock broker
reached through ``loadtest.kafka_bridge``): a rank of the two-rank streaming job is SIGKILLed and
torchrun brings the job back by itself; version 2 is published while samples arrive, and both
ranks move to it at one look; every sample produced is trained exactly once across the deltas of
both versions (none lost, none twice, a joiner's re-emitted samples dropped)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

import model_store as ms
from loadtest import kafka_bridge, mockbroker
from model_store.deltas import DeltaManifest, read_delta, read_keys
from tests.helpers import ROOT, doc_blocks, split_comment, wait_until
from tests.training.follow.helpers import NAME, doc_env, retrained, schema_of, torchrun_workers
from tests.training.sources.samples import key, produce, records

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:.*torch.jit.load. is deprecated")]
MOUNT = "/mnt/recserve"
TOPIC = "samples"  # the documented line's
PARTITIONS = 4


def _lines() -> tuple[str, str]:
    """The documented job line (both hosts) and publish line (any host)."""
    (block,) = doc_blocks("docs/training.md", "Streaming ranks on several hosts")
    (job, where), (publish, anywhere) = (split_comment(line) for line in block)
    assert where == "host A and host B" and anywhere.startswith("any host"), block
    return job, publish


def _published(store: Path, version: str) -> list[tuple[Path, DeltaManifest]]:
    """(directory, record) of every published delta of ``version``, in order."""
    vdir = ms.version_dir(store, NAME, version)
    out = []
    for seq in ms.list_deltas(vdir):
        record = read_delta(ms.delta_dir(vdir, seq))
        assert record is not None, f"delta {version}/{seq} has no record"
        out.append((ms.delta_dir(vdir, seq), record))
    return out


def _keys(published: list[tuple[Path, DeltaManifest]]) -> set[tuple[str, int]]:
    """The keys the last of ``published`` records as trained (its window: every key here)."""
    ddir, record = published[-1]
    keys = [key(k) for k in read_keys(ddir, record)[0]]
    assert len(keys) == len(set(keys))
    return set(keys)


def test_a_killed_rank_comes_back_and_both_ranks_follow_a_new_version_training_every_sample_once(
    network, store, tmp_path
):
    job_line, publish_line = _lines()
    v1 = ms.current(store, NAME)
    assert v1 is not None
    v2 = retrained(store, v1)  # trained meanwhile, not published
    assert publish_line.split()[-1] == v2
    schema = schema_of(store)
    a, b, c, d, e = (records(schema, 200, per_request=20, prefix=p) for p in "abcde")
    net = network(2, ["host-a", "host-b"])
    logs = [tmp_path / f"{host.hostname}.log" for host in net.hosts]
    binds = {str(store): MOUNT}
    topics = [mockbroker.TopicSpec(TOPIC, PARTITIONS), mockbroker.TopicSpec(TOPIC + ".dead", 1)]
    with mockbroker.running(topics) as broker, kafka_bridge.running(net.hosts, broker.bootstrap):
        env = doc_env() | {"KAFKA_BROKERS": broker.bootstrap, "CUDA_VISIBLE_DEVICES": "",
                           "TMPDIR": str(tmp_path)}  # fmt: skip
        produce(broker.bootstrap, TOPIC, a, partitions=PARTITIONS)
        jobs = [host.popen(["bash", "-c", job_line], log, env=env, binds=binds, cwd=ROOT)
                for host, log in zip(net.hosts, logs, strict=True)]  # fmt: skip

        def running() -> None:
            """Fail now, not at a deadline, when a host's job ended."""
            for job, log in zip(jobs, logs, strict=True):
                assert job.poll() is None, f"{log.name}: exited {job.returncode}: {log.read_text()[-4000:]}"

        def trained(*versions: str) -> int:
            """Samples in the published deltas of ``versions``."""
            running()
            return sum(r.samples for v in versions for _, r in _published(store, v))

        def ranks(before: frozenset[int] = frozenset()) -> dict[int, int] | None:
            """Both ranks' pids, once both run as processes other than ``before``."""
            running()
            pids = torchrun_workers(net.hosts)
            return pids if len(pids) == 2 and not before & set(pids.values()) else None

        wait_until(lambda: trained(v1) == 200, 180, "the first samples in a delta")
        produce(broker.bootstrap, TOPIC, b, partitions=PARTITIONS)
        wait_until(lambda: trained(v1) == 400, 60, "the next samples in a delta")
        # the next samples arrive, and rank 0 (its PS shards with it) is killed as they train
        first = wait_until(ranks, 30, "both ranks")
        produce(broker.bootstrap, TOPIC, c, partitions=PARTITIONS)
        os.kill(first[0], signal.SIGKILL)
        wait_until(lambda: ranks(frozenset(first.values())), 120, "torchrun starting both ranks again")
        wait_until(lambda: trained(v1) == 600, 120, "the restarted job's deltas")
        # version 2 is published while samples arrive
        produce(broker.bootstrap, TOPIC, d, partitions=PARTITIONS)
        published = net.hosts[0].run(["bash", "-c", publish_line], binds=binds, env=env, cwd=ROOT,
                                     capture_output=True, text=True, timeout=120)  # fmt: skip
        assert published.returncode == 0, published.stdout + published.stderr
        moved = f"CURRENT moved {v1} -> {v2}"
        wait_until(lambda: running() or all(moved in log.read_text() for log in logs), 120,
                   "both ranks moving to version 2")  # fmt: skip
        # a joiner re-emits the first samples after its restart; then new ones
        produce(broker.bootstrap, TOPIC, a + e, partitions=PARTITIONS)
        wait_until(lambda: trained(v1, v2) == 1000, 120, "every sample in a delta")
        for job in jobs:
            os.killpg(job.pid, signal.SIGTERM)  # the ranks end together at their next look
        for job, log in zip(jobs, logs, strict=True):
            try:
                job.wait(timeout=90)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{log.name} did not stop: {log.read_text()[-4000:]}") from None

    in_v1, in_v2 = _published(store, v1), _published(store, v2)
    produced = {(r[0], r[1]) for batch in (a, b, c, d, e) for r in batch}
    keys_v1, keys_v2 = _keys(in_v1), _keys(in_v2)
    # v2 starts where v1 ended: its first delta, cut at the move, records v1's offsets and keys
    (first_v2, start), last_v1 = in_v2[0], in_v1[-1][1]
    assert first_v2.name == "0" and start.samples == 0 and start.positions == last_v1.positions
    assert _keys(in_v2[:1]) == keys_v1
    # exactly once: each version's samples are the keys first trained into it, all of them
    assert sum(r.samples for _, r in in_v1) == len(keys_v1), "a sample trained twice into version 1"
    assert sum(r.samples for _, r in in_v2) == len(keys_v2 - keys_v1), "a sample trained twice"
    assert keys_v2 == produced, "a sample never trained"
    assert sum(r.samples for _, r in in_v2) >= 200  # the last samples went into version 2
    every = [int(r[0].rpartition("-")[2]) % PARTITIONS for batch in (a, b, c, d, a, e) for r in batch]
    assert in_v2[-1][1].positions == {f"{TOPIC}/{p}": every.count(p) for p in range(PARTITIONS)}
    # both ranks of the restarted job followed version 2 to the end
    texts = [log.read_text() for log in logs]
    summaries = [json.loads(ln) for t in texts for ln in t.splitlines() if ln.startswith('{"version"')]
    assert [(s["version"], s["reloads"]) for s in summaries] == [(v2, 1), (v2, 1)], texts
    assert sum(t.count("resuming at") for t in texts) == 2, "a restarted rank resumed from no record"
