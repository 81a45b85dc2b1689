"""Continuous training from a stream of samples (``recserve train --follow --stream kafka://``)
against the mock Kafka cluster: offsets and trained keys in every delta, exactly once across a
SIGKILL and a re-emitting joiner, dead letters, progressive validation."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

import model_store as ms
from model_store.deltas import DeltaManifest, read_delta, read_keys
from stream import dead_letter
from stream.sample_batch import KIND_BIT
from tests.helpers import ROOT, doc_blocks, free_port, wait_until
from tests.training.follow.helpers import NAME, bash, doc_env, schema_of, serving_stores, stream_cfg
from tests.training.sources.samples import key, produce, records
from training import sources
from training.follow.trainer import FollowTrainer, follow
from training.sources import Reading

pytestmark = pytest.mark.filterwarnings("ignore:.*torch.jit.load. is deprecated")


def _published(store: Path) -> list[tuple[Path, DeltaManifest]]:
    """(delta directory, its DELTA.json record) of every published delta of the served version."""
    vdir = ms.version_dir(store, NAME, ms.current(store, NAME))
    out = []
    for seq in ms.list_deltas(vdir):
        record = read_delta(ms.delta_dir(vdir, seq))
        if record is not None:
            out.append((ms.delta_dir(vdir, seq), record))
    return out


def _dead_letters(bootstrap: str, topic: str, n: int) -> list:
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "dead-reader", "auto.offset.reset": "earliest"})
    c.assign([TopicPartition(topic, 0, 0)])
    got: list = []
    try:
        wait_until(lambda: got.extend(c.consume(10, 0.2)) or len(got) >= n, 30, f"{n} dead letters")
    finally:
        c.close()
    return got


def test_samples_train_into_a_delta_with_their_offsets(kafka, new_topic, store):
    topic = new_topic("samples-offsets")
    recs = records(schema_of(store), 200, per_request=20)
    produce(kafka.bootstrap, topic, recs)
    produce(kafka.bootstrap, topic, [("r-0", 0, 0.0, b"not a sample")])  # partition 0, after the rest

    port = free_port()
    cfg = stream_cfg(
        store, f"kafka://{kafka.bootstrap}/{topic}", once=True, delta_interval_s=3600, metrics_port=port
    )
    with FollowTrainer(cfg) as trainer:
        result = trainer.run(threading.Event())
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    assert result.rows == 200 and result.duplicates == 0 and result.refused == 1
    # one step per consume of 64 records, whatever partitions they lie in (a step per partition's
    # chunk made more, smaller ones)
    assert result.steps == 4, result.steps
    # the consumer lag: every record was behind at the first look, none at the last
    assert result.max_lag_samples == 201 and "recserve_follow_lag_samples 0.0" in metrics
    (ddir, record), = _published(store)  # fmt: skip
    assert "recserve_follow_delta_cut_seconds_count 1.0" in metrics  # the one delta's cut, timed
    assert "recserve_follow_delta_publish_seconds_count 1.0" in metrics  # and when it was published
    in_p0 = sum(int(r[0].rpartition("-")[2]) % 2 == 0 for r in recs)
    assert record.positions == {f"{topic}/0": in_p0 + 1, f"{topic}/1": 200 - in_p0}
    assert record.samples == 200 and record.source == f"kafka://{kafka.bootstrap}/{topic}"
    keys, _ = read_keys(ddir, record)
    assert sorted(map(key, keys)) == sorted((r[0], r[1]) for r in recs)
    # progressive validation: every sample scored before it trained, per delta and in all
    assert result.progressive_total is not None and result.progressive_total.samples == 200
    assert 0 <= result.progressive_total.auc <= 1 and result.progressive_total.logloss > 0
    (window,) = result.progressive  # one delta: its window's exact figures, the run's tallied ones
    total = result.progressive_total
    assert (window.samples, window.logloss) == (total.samples, pytest.approx(total.logloss, abs=1e-6))
    assert window.auc == pytest.approx(total.auc, abs=5e-4) and (record.auc, record.logloss) == (
        window.auc,
        window.logloss,
    )
    assert f"recserve_follow_progressive_auc {record.auc}" in metrics
    for line in (
        "recserve_follow_samples_total 200.0",
        "recserve_follow_refused_total 1.0",
        "recserve_follow_duplicates_total 0.0",
        f'recserve_follow_offset{{unit="{topic}/1"}} {200 - in_p0}.0',
    ):
        assert line in metrics, line  # fmt: skip
    # the malformed record went to the dead-letter topic, as it was, with why and where it was read
    (dead,) = _dead_letters(kafka.bootstrap, dead_letter.topic_of(topic), 1)
    headers = dead_letter.read_headers(dead.headers())
    assert dead.value() == b"not a sample" and headers["reason"].startswith("a sample too short")
    assert headers["topic"] == topic and headers["partition"] in ("0", "1") and int(headers["offset"]) >= 0
    # serving applies the delta
    assert {s.delta_seq for s in serving_stores(store)} == {int(ddir.name)}


def test_a_re_emitted_sample_is_never_trained_twice(kafka, new_topic, store):
    topic = new_topic("samples-again")
    spec = f"kafka://{kafka.bootstrap}/{topic}"
    first = records(schema_of(store), 100, per_request=20)
    produce(kafka.bootstrap, topic, first)
    assert follow(stream_cfg(store, spec, once=True)).rows == 100
    # the joiner restarts and emits them again, with 40 new ones
    more = records(schema_of(store), 40, per_request=20, prefix="s", skip=100)
    produce(kafka.bootstrap, topic, first + more)
    again = follow(stream_cfg(store, spec, once=True))
    assert (again.rows, again.duplicates) == (40, 100)
    published = [record for _, record in _published(store)]
    assert sum(r.samples for r in published) == 140 and sum(r.duplicates for r in published) == 100
    # nothing but re-emitted samples: none trained, yet a delta records the offsets read past
    # them (a restart from the last delta's offsets must not re-read what the job dropped)
    produce(kafka.bootstrap, topic, first)
    dropped = follow(stream_cfg(store, spec, once=True))
    assert (dropped.rows, dropped.duplicates, len(dropped.deltas)) == (0, 100, 1)
    in_p0 = sum(int(r[0].rpartition("-")[2]) % 2 == 0 for r in first + first + more + first)
    ends = {f"{topic}/0": in_p0, f"{topic}/1": 340 - in_p0}
    _, record = _published(store)[-1]
    assert (record.positions, record.samples, record.duplicates) == (ends, 0, 100)
    # a consume of nothing but a malformed record: refused, nothing trained, the trainer goes on
    produce(kafka.bootstrap, topic, [("r-1", 0, 0.0, b"RSSM broken")])
    last = follow(stream_cfg(store, spec, once=True))
    assert (last.rows, last.refused, last.duplicates) == (0, 1, 0)
    _, record = _published(store)[-1]
    assert record.positions == ends | {f"{topic}/1": 340 - in_p0 + 1}


def test_a_trainer_reading_only_duplicates_still_cuts_on_its_interval(kafka, new_topic, store):
    """Mid-run, not only at its end: killed after a stretch of re-emitted samples, it resumes past
    them (its last delta's offsets are where it read to)."""
    topic = new_topic("samples-dups")
    spec = f"kafka://{kafka.bootstrap}/{topic}"
    recs = records(schema_of(store), 40, per_request=20)
    produce(kafka.bootstrap, topic, recs)
    assert follow(stream_cfg(store, spec, once=True)).rows == 40
    produce(kafka.bootstrap, topic, recs)  # re-emitted
    cfg = stream_cfg(store, spec, batch_size=16, delta_interval_s=60, once=True)
    clock = itertools.count(0.0, 61.0).__next__  # a delta due at every look at the clock
    with FollowTrainer(cfg, clock=clock) as trainer:  # driven by hand: one consume's chunk, then gone
        trainer._follow_current()
        reading = Reading(trainer.loaded.schema, poll_s=0.2, once=True, batch_rows=16)
        keyed = (
            c
            for c in sources.open_source(spec, reading, "kafka", trainer.ledger).chunks()
            if isinstance(c, sources.KeyedChunk)
        )
        chunk = next(keyed)
        trainer.train_keyed(chunk)
        assert trainer.result.rows == 0 and len(trainer.result.deltas) == 1
    _, record = _published(store)[-1]
    assert (record.samples, record.duplicates) == (0, chunk.rows)
    assert record.positions[chunk.start.unit] == chunk.stop.row


def test_a_crash_after_a_delta_retrains_only_what_no_published_delta_holds(kafka, new_topic, store):
    topic = new_topic("samples-crash")
    spec = f"kafka://{kafka.bootstrap}/{topic}"
    recs = records(schema_of(store), 200, per_request=20)
    produce(kafka.bootstrap, topic, recs)
    cfg = stream_cfg(store, spec, batch_size=16, delta_interval_s=3600, once=True)
    with FollowTrainer(cfg) as crashed:  # driven by hand: a delta, more steps, half a delta, then gone
        crashed._follow_current()
        lv = crashed.loaded
        reading = Reading(lv.schema, poll_s=0.2, once=True, batch_rows=16)
        keyed = (
            c
            for c in sources.open_source(spec, reading, "kafka", crashed.ledger).chunks()
            if isinstance(c, sources.KeyedChunk)
        )
        for _ in range(4):
            crashed.train_keyed(next(keyed))
        crashed.cut()
        for _ in range(3):
            crashed.train_keyed(next(keyed))
        lv.cluster.dump(ms.delta_dir(lv.vdir, lv.cluster.stores[0].delta_seq + 1), delta=True)  # no _SUCCESS
    (_, first), = _published(store)  # fmt: skip
    assert 0 < first.samples < 200

    again = follow(cfg)

    assert again.rows == 200 - first.samples and again.duplicates == 0
    published = _published(store)
    assert sum(r.samples for _, r in published) == 200
    ddir, last = published[-1]
    assert sorted(map(key, read_keys(ddir, last)[0])) == sorted((r[0], r[1]) for r in recs)


def doc_lines() -> tuple[str, str, str]:
    """docs/training.md's "Training from the stream": the broker, a follower, a --once catch-up."""
    (lines,) = doc_blocks("docs/training.md", "Training from the stream")
    assert len(lines) == 3 and lines[2].endswith("--once"), lines
    broker, follower, once = lines
    return broker, follower, once


@pytest.mark.slow
def test_the_documented_lines_train_exactly_once_across_a_sigkill(follow_version, tmp_path):
    broker_line, follower_line, once_line = doc_lines()
    artifacts = tmp_path / "artifacts"  # the lines' model directory: artifacts/criteo
    shutil.copytree(follow_version, artifacts)
    env = doc_env()
    broker = bash(broker_line, tmp_path, env, stdout=subprocess.PIPE, text=True)
    try:
        assert broker.stdout is not None
        bootstrap = broker.stdout.readline().strip().removeprefix("BOOTSTRAP=")
        env["KAFKA_BROKERS"] = bootstrap
        batches = [records(schema_of(artifacts), 200, per_request=20, prefix=p) for p in ("a", "b", "c")]
        produce(bootstrap, "samples", batches[0])
        proc = bash(follower_line, tmp_path, env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_until(lambda: _published(artifacts), 120, "a delta cut from the stream")
            produce(bootstrap, "samples", batches[1])  # arriving while it trains
            wait_until(
                lambda: sum(r.samples for _, r in _published(artifacts)) > 200, 60, "more samples trained"
            )
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # the joiner re-emits the first batch after its own restart; then a third batch
        produce(bootstrap, "samples", batches[0] + batches[2])
        done = bash(once_line, tmp_path, env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = done.communicate(timeout=180)
        assert done.returncode == 0, err
    finally:
        os.killpg(broker.pid, signal.SIGTERM)
        broker.wait(timeout=30)
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["duplicates"] >= 200 and summary["progressive_total"]["samples"] == summary["rows"]

    published = _published(artifacts)
    produced = {(r[0], r[1]) for b in batches for r in b}
    samples = sum(record.samples for _, record in published)
    ddir, last = published[-1]
    keys = [key(k) for k in read_keys(ddir, last)[0]]
    assert samples == len(produced), "a sample trained into two published deltas, or one never trained"
    assert len(keys) == len(set(keys)) and set(keys) == produced
    assert last.positions == {"samples/0": 400, "samples/1": 400}


@pytest.mark.slow
def test_two_ranks_split_the_partitions_and_train_every_sample_once(kafka, new_topic, store, tmp_path):
    """torchrun, two ranks: each trains its partitions (partition % 2 == rank) through its own
    worker on the PS shards rank 0 started with the version; rank 0 writes every delta, with both
    ranks' offsets and keys; a second job resumes from them and drops what the joiner re-emits."""
    topic = new_topic("samples-ranks", partitions=4)
    spec = f"kafka://{kafka.bootstrap}/{topic}"
    first = records(schema_of(store), 160, per_request=20)
    produce(kafka.bootstrap, topic, first, partitions=4)
    env = os.environ | {"PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path), "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "recserve", "train", "--follow", str(store / NAME), "--stream", spec, "--once",
           "--batch-size", "32", "--poll-s", "0.2", "--delta-interval-s", "1"]  # fmt: skip

    def job() -> list[dict]:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
        return [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"version"')]

    summaries = job()
    assert sorted(tuple(sorted(s["files"])) for s in summaries) == [
        (f"{topic}/0", f"{topic}/2"), (f"{topic}/1", f"{topic}/3")]  # fmt: skip
    rank0, rank1 = sorted(summaries, key=lambda s: f"{topic}/0" not in s["files"])
    assert rank0["rows"] == 160 and rank0["deltas"] == rank1["deltas"] != []  # rank 0 counts the job's
    assert rank1["rows"] == sum(int(r[0].rpartition("-")[2]) % 2 == 1 for r in first) > 0  # rank 1: its own
    # each rank's consumer lag: its partitions' records, all behind at its first look
    assert (rank0["max_lag_samples"], rank1["max_lag_samples"]) == (160 - rank1["rows"], rank1["rows"])
    # the joiner re-emits the first samples after its restart, with new ones
    more = records(schema_of(store), 40, per_request=20, prefix="s", skip=160)
    produce(kafka.bootstrap, topic, first + more, partitions=4)
    again = max(job(), key=lambda s: s["rows"])  # rank 0's: the job's counts
    assert (again["rows"], again["duplicates"]) == (40, 160)

    published = _published(store)
    ddir, last = published[-1]
    keys = [key(k) for k in read_keys(ddir, last)[0]]
    produced = {(r[0], r[1]) for r in first + more}
    assert sum(r.samples for _, r in published) == len(produced), "a sample trained twice, or never"
    assert len(keys) == len(set(keys)) and set(keys) == produced
    in_part = [sum(int(r[0].rpartition("-")[2]) % 4 == p for r in first + first + more) for p in range(4)]
    assert last.positions == {f"{topic}/{p}": in_part[p] for p in range(4)}
    assert {s.delta_seq for s in serving_stores(store)} == {int(ddir.name)}  # serving applies them


def test_a_second_trainer_stands_by_and_takes_over_where_the_first_stopped(kafka, new_topic, store):
    """The first trainer holds the model's lock; the second keeps its tables at the newest delta
    without reading or writing, and when the first is gone it trains on from its last delta:
    every sample trained once, the deltas' sequence unbroken."""
    topic = new_topic("samples-standby")
    spec = f"kafka://{kafka.bootstrap}/{topic}"
    batches = [records(schema_of(store), 100, per_request=20, prefix=p) for p in ("a", "b", "c")]
    ports = free_port(), free_port()

    def samples_in_deltas() -> int:
        return sum(r.samples for _, r in _published(store))

    def metric(port: int, name: str) -> str:
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        return next((ln.split()[-1] for ln in body.splitlines() if ln.startswith(name + " ")), "")

    produce(kafka.bootstrap, topic, batches[0])
    stops = threading.Event(), threading.Event()
    results: list = [None, None]
    with FollowTrainer(stream_cfg(store, spec, delta_interval_s=0.2, metrics_port=ports[0])) as first, \
            FollowTrainer(stream_cfg(store, spec, delta_interval_s=0.2, metrics_port=ports[1])) as second:  # fmt: skip

        def run(i: int, trainer: FollowTrainer) -> None:
            results[i] = trainer.run(stops[i])
            if i == 0:
                trainer.close()  # lets go of the lock, as a process's exit does

        threads = [
            threading.Thread(target=run, args=(i, t), daemon=True) for i, t in enumerate((first, second))
        ]
        threads[0].start()
        wait_until(lambda: samples_in_deltas() == 100, 60, "the first trainer's deltas")
        threads[1].start()
        wait_until(lambda: metric(ports[1], "recserve_follow_standby") == "1.0", 60, "the second standing by")
        produce(kafka.bootstrap, topic, batches[1])
        wait_until(lambda: samples_in_deltas() == 200, 60, "the first trainer's next deltas")
        newest = int(_published(store)[-1][0].name)

        def standby_at(seq: int) -> bool:  # the gauge is up before the standby's first load ends
            lv = second.loaded
            return lv is not None and lv.cluster.stores[0].delta_seq == seq

        wait_until(lambda: standby_at(newest), 30, "the standby at the newest delta")
        stops[0].set()
        threads[0].join(60)
        produce(kafka.bootstrap, topic, batches[2])
        wait_until(lambda: samples_in_deltas() == 300, 60, "the second trainer's deltas")
        assert metric(ports[1], "recserve_follow_standby") == "0.0"
        stops[1].set()
        threads[1].join(60)
    assert results[0].rows == 200 and results[1].rows == 100 and results[1].duplicates == 0
    published = _published(store)
    assert [int(d.name) for d, _ in published] == list(range(len(published)))  # one writer at a time
    ddir, last = published[-1]
    assert sorted(map(key, read_keys(ddir, last)[0])) == sorted((r[0], r[1]) for b in batches for r in b)


@pytest.mark.slow
def test_a_sigkilled_trainer_trains_every_correction_once(kafka, new_topic, store, tmp_path):
    """First labels and their corrections, (request, item, kind) keys: a trainer SIGKILLed between
    deltas, the joiner re-emitting what it had, a --once catch-up: each key trained once."""
    topic = new_topic("samples-corrections")
    spec = f"kafka://{kafka.bootstrap}/{topic}"
    batches = [records(schema_of(store), 200, per_request=20, prefix=p, corrections=3) for p in "ab"]
    assert all(any(r[1] & KIND_BIT for r in b) for b in batches)
    line = [sys.executable, "-m", "recserve", "train", "--follow", str(store / NAME), "--stream", spec,
            "--batch-size", "16", "--delta-interval-s", "0.2", "--poll-s", "0.2", "--delayed-feedback", "fnw"]  # fmt: skip
    produce(kafka.bootstrap, topic, batches[0])
    env = doc_env()
    log = (tmp_path / "trainer.log").open("wb")  # read on a failure: a pipe nobody reads could fill
    proc = subprocess.Popen(line, cwd=tmp_path, env=env, start_new_session=True, stderr=log)
    try:
        wait_until(
            lambda: sum(r.samples for _, r in _published(store)) >= len(batches[0]), 120, "batch a trained"
        )
        produce(kafka.bootstrap, topic, batches[1])
        wait_until(
            lambda: sum(r.samples for _, r in _published(store)) > len(batches[0]), 60, "b being trained"
        )
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    produce(kafka.bootstrap, topic, batches[0] + batches[1])  # the joiner's restart re-emits both
    done = subprocess.run(
        [*line, "--once"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["duplicates"] >= len(batches[0])  # re-emits known
    produced = {(r[0], r[1]) for b in batches for r in b}
    published = _published(store)
    ddir, last = published[-1]
    keys = [key(k) for k in read_keys(ddir, last)[0]]
    assert sum(r.samples for _, r in published) == len(produced) == sum(len(b) for b in batches)
    assert len(keys) == len(set(keys)) and set(keys) == produced
