"""Continuous training into the served version (training/follow/trainer.py, ``recserve train --follow``).

One small version is trained and published once per session (``follow_version``, conftest.py);
every test follows a copy of it (``store``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import model_store as ms
from model_store.deltas import read_delta
from model_store.shards import read_meta
from tests.helpers import ROOT, wait_until
from tests.training.follow.helpers import NAME, SAMPLE, file_signs, lookup, retrained, serving_stores
from training.config import TrainConfig
from training.follow.config import FollowConfig
from training.follow.cut import DeltaCut
from training.follow.trainer import FollowTrainer, follow
from training.train import train


@pytest.fixture
def watch(tmp_path) -> Path:
    d = tmp_path / "incoming"
    d.mkdir()
    return d


def _cfg(store: Path, watch: Path, **kw) -> FollowConfig:
    return FollowConfig(**({"follow": str(store / NAME), "watch": str(watch), "poll_s": 0.2} | kw))


@pytest.mark.filterwarnings("ignore:.*torch.jit.load. is deprecated")
def test_once_cuts_a_delta_that_serving_applies(store, watch):
    shutil.copy(SAMPLE, watch / SAMPLE.name)
    (watch / ".sample-being-written.csv").write_text(SAMPLE.read_text()[:5000])  # hidden: in progress
    (watch / "more.csv.tmp").write_text(SAMPLE.read_text())  # renamed into place when complete
    version = ms.current(store, NAME)
    vdir = ms.version_dir(store, NAME, version)
    dense_sha = ms.sha256_file(vdir / "dense/model.pt")
    before = ms.list_deltas(vdir)

    with FollowTrainer(_cfg(store, watch, once=True)) as trainer:
        result = trainer.run(threading.Event())
        signs = file_signs(store, SAMPLE)
        trained_rows = lookup(trainer.loaded.cluster.stores, signs)
        dense_after = trainer.loaded.dense.state_dict()

    # one delta, complete, of the served version, after the ones cut while training
    assert result.files == [SAMPLE.name] and result.rows == 200
    seq = (max(before) + 1) if before else 0
    assert result.deltas == [(version, seq)]
    ddir = ms.delta_dir(vdir, seq)
    assert (ddir / ms.SUCCESS).is_file() and ms.list_deltas(vdir) == [*before, seq]
    metas = [read_meta(p) for p in sorted(ddir.glob("shard-*"))]
    assert len(metas) == ms.read_manifest(vdir, verify=False).num_shards
    assert {m.base_version for m in metas} == {version} and {m.delta_seq for m in metas} == {seq}

    # serving applies it: the file's rows changed and equal the trainer's; the others did not
    base = serving_stores(store, deltas=False)
    served = serving_stores(store)
    assert {s.delta_seq for s in served} == {seq}
    base_rows, served_rows = lookup(base, signs), lookup(served, signs)
    np.testing.assert_array_equal(served_rows, trained_rows)
    assert (np.abs(served_rows - base_rows).max(axis=1) > 0).all()
    others = np.setdiff1d(np.concatenate([s.snapshot().signs for s in base]), signs)[:2000]
    np.testing.assert_array_equal(lookup(served, others), lookup(base, others))

    # the dense model is the served one, untouched; the version still validates
    assert ms.sha256_file(vdir / "dense/model.pt") == dense_sha
    fresh = torch.jit.load(str(vdir / "dense/model.pt"))
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, dense_after[k]), k
    ms.read_manifest(vdir, verify=True)

    # a second --once: nothing new, nothing cut; it resumes from the served rows (delta included)
    with FollowTrainer(_cfg(store, watch, once=True)) as again:
        assert again.run(threading.Event()).deltas == []
        np.testing.assert_array_equal(lookup(again.loaded.cluster.stores, signs), trained_rows)
    assert ms.list_deltas(vdir) == [*before, seq]


def test_the_trainer_freezes_what_it_loaded_once(store, watch, monkeypatch):
    # the imports and the first version out of the collector's scans (serving/memory.py): its full
    # collections held the GIL for 117-305 ms every 20-50 s of a stream at 10,000 samples/s
    from serving import memory

    calls: list[int] = []
    monkeypatch.setattr(memory, "freeze_loaded", lambda: calls.append(1) or 0)
    shutil.copy(SAMPLE, watch / SAMPLE.name)
    with FollowTrainer(_cfg(store, watch, once=True)) as trainer:
        trainer.run(threading.Event())
        assert calls == [1]
        trainer.keep_up()  # a later look at CURRENT loads nothing new, freezes nothing again
        assert calls == [1]


def test_a_delta_is_written_on_its_own_thread_while_training_goes_on(store, watch, monkeypatch):
    # the cut takes the rows and the record in memory; the files, _SUCCESS and announce follow on
    # the cut's thread, and the ledger claims the rows only once the delta holding them is published
    gate = threading.Event()
    publish = DeltaCut._publish
    monkeypatch.setattr(DeltaCut, "_publish", lambda self, *a: gate.wait(60) and publish(self, *a))
    shutil.copy(SAMPLE, watch / SAMPLE.name)
    cfg = _cfg(store, watch, once=True, delta_interval_s=1e-6, batch_size=50)
    vdir = ms.version_dir(store, NAME, ms.current(store, NAME))
    box: dict = {}
    with FollowTrainer(cfg) as trainer:
        run = threading.Thread(target=lambda: box.update(result=trainer.run(threading.Event())))
        run.start()
        try:  # the step after the first cut trains; the next cut waits for the first's files
            wait_until(lambda: trainer.result.rows >= 100, 60, "a step trained past the cut in flight")
            [(_, seq)] = trainer.result.deltas
            assert not (ms.delta_dir(vdir, seq) / ms.SUCCESS).exists()
            assert not cfg.ledger.exists()  # nothing published: a restart trains the rows again
        finally:
            gate.set()
            run.join(60)
    result = box["result"]
    assert result.rows == 200 and [s for _, s in result.deltas] == [seq, seq + 1, seq + 2, seq + 3]
    records = [read_delta(ms.delta_dir(vdir, s)) for _, s in result.deltas]
    assert [(r.positions[SAMPLE.name], r.samples) for r in records] == [
        (50, 50),
        (100, 50),
        (150, 50),
        (200, 50),
    ]
    assert json.loads(cfg.ledger.read_text())["files"][SAMPLE.name] == {"rows": 200, "done": True}


def test_a_delta_whose_write_fails_on_its_thread_stops_the_trainer_and_commits_nothing(
    store, watch, monkeypatch
):
    # the disk fills while delta 2's files are written on the cut's thread: the error reaches the
    # training thread, the ledger holds delta 1's progress only, and a restart trains the rest once
    encode, calls = ms.shards.encode_delta, []

    def full_disk(ddir: Path, vdir: Path) -> None:
        calls.append(ddir)
        if len(calls) == 2:
            raise OSError(28, "No space left on device", str(ddir))
        encode(ddir, vdir)

    monkeypatch.setattr(ms.shards, "encode_delta", full_disk)
    shutil.copy(SAMPLE, watch / SAMPLE.name)
    cfg = _cfg(store, watch, once=True, delta_interval_s=1e-6, batch_size=50)
    vdir = ms.version_dir(store, NAME, ms.current(store, NAME))
    with FollowTrainer(cfg) as trainer, pytest.raises(OSError, match="No space left"):
        trainer.run(threading.Event())
    first, failed = calls
    assert (first / ms.SUCCESS).is_file() and not (failed / ms.SUCCESS).exists()
    assert ms.list_deltas(vdir)[-1] == int(first.name)  # the half-written one is no delta
    assert json.loads(cfg.ledger.read_text())["files"][SAMPLE.name] == {"rows": 50, "done": False}

    monkeypatch.setattr(ms.shards, "encode_delta", encode)
    with FollowTrainer(cfg) as again:
        result = again.run(threading.Event())
    assert result.deltas[0][1] == int(failed.name)  # its directory written again, whole this time
    records = [read_delta(ms.delta_dir(vdir, s)) for _, s in result.deltas]
    assert sum(r.samples for r in records) == 150 and records[-1].positions[SAMPLE.name] == 200
    assert json.loads(cfg.ledger.read_text())["files"][SAMPLE.name] == {"rows": 200, "done": True}


def test_follow_loop_cuts_deltas_and_reloads_on_a_new_current(store, watch):
    v1 = ms.current(store, NAME)
    stop = threading.Event()
    box: dict = {}
    cfg = _cfg(store, watch, delta_interval_s=0.2, poll_s=0.1, max_seconds=60)
    thread = threading.Thread(target=lambda: box.update(result=follow(cfg, stop)))
    thread.start()
    try:

        def drop(name: str) -> None:  # hidden name, rename, marker: complete at first sight
            shutil.copy(SAMPLE, watch / f".{name}")
            (watch / f".{name}").rename(watch / name)
            (watch / f"{name}.done").write_text("")

        def wait_delta(version: str, n: int) -> None:
            def cut() -> bool:
                assert thread.is_alive(), "the follow loop ended"  # fail now, not at the deadline
                return len(ms.list_deltas(ms.version_dir(store, NAME, version))) >= n

            wait_until(cut, 30, f"{n} deltas of version {version} cut")

        n1 = len(ms.list_deltas(ms.version_dir(store, NAME, v1)))
        drop("a.csv")
        wait_delta(v1, n1 + 1)

        # a new full version is published (a copy of v1 without its deltas): the follower moves
        v2 = str(int(v1) + 1)
        shutil.copytree(
            ms.version_dir(store, NAME, v1),
            ms.version_dir(store, NAME, v2),
            ignore=shutil.ignore_patterns("deltas"),
        )
        ms.publish(store, NAME, v2)
        drop("b.csv")
        wait_delta(v2, 1)
    finally:
        stop.set()
        thread.join(30)
    result = box["result"]
    assert result.reloads == 1 and result.version == v2
    assert result.files == ["a.csv", "b.csv"] and result.rows == 400
    # (a slow machine may cut a file in two deltas: the seqs only need to be consecutive)
    for version, first in ((v1, n1), (v2, 0)):
        seqs = [seq for v, seq in result.deltas if v == version]
        assert seqs == list(range(first, first + len(seqs))) and seqs, result.deltas
    assert result.deltas[-1][0] == v2
    meta = read_meta(next(ms.delta_dir(ms.version_dir(store, NAME, v2), 0).glob("shard-*")))
    assert meta.base_version == v2


def _delta_signs(store: Path, version: str, seq: int) -> set[int]:
    ddir = ms.delta_dir(ms.version_dir(store, NAME, version), seq)
    metas = [read_meta(p) for p in ddir.glob("shard-*")]
    assert metas and {m.base_version for m in metas} == {version}
    return {int(x) for part in ddir.glob("shard-*") for x in np.load(part / "signs.npy")}


def test_a_publish_mid_follow_moves_the_next_deltas_to_the_new_version_only(store, watch):
    """Rows trained before `recserve publish V2` are cut into V1 (the version they were trained
    against); the rows after it go into V2's deltas only; serving V2 applies V2's deltas and refuses
    V1's."""
    from model_store.errors import StoreError

    v1 = ms.current(store, NAME)
    n1 = len(ms.list_deltas(ms.version_dir(store, NAME, v1)))
    lines = SAMPLE.read_text().splitlines(keepends=True)
    for name, rows in (("a.csv", lines[1:101]), ("b.csv", lines[101:])):
        (watch / f".{name}").write_text("".join([lines[0], *rows]))
    a_signs = {int(x) for x in file_signs(store, watch / ".a.csv")}
    b_signs = {int(x) for x in file_signs(store, watch / ".b.csv")}
    stop = threading.Event()
    box: dict = {}
    # no timed cuts: the only cuts are the one the move makes and the final one
    trainer = FollowTrainer(_cfg(store, watch, delta_interval_s=3600, poll_s=0.05, max_seconds=60))
    thread = threading.Thread(target=lambda: box.update(result=trainer.run(stop)))
    thread.start()

    def running() -> bool:
        assert thread.is_alive(), "the follow trainer ended"  # fail now, not at the deadline
        return True

    try:

        def train(name: str, rows: int) -> None:
            (watch / f".{name}").rename(watch / name)
            (watch / f"{name}.done").write_text("")
            wait_until(lambda: running() and trainer.result.rows >= rows, 60, f"{rows} rows trained")

        train("a.csv", 100)
        assert trainer.result.deltas == []  # a.csv's rows are pending
        v2 = retrained(store, v1)
        assert ms.publish(store, NAME, v2) == v2  # same schema and shape: the gate passes
        wait_until(lambda: running() and trainer.result.version == v2, 60, "the trainer moved to v2")
        train("b.csv", 200)
    finally:
        stop.set()
        thread.join(60)
        trainer.close()
    result = box["result"]
    assert result.reloads == 1 and result.deltas == [(v1, n1), (v2, 0)], result.deltas
    assert ms.list_deltas(ms.version_dir(store, NAME, v1)) == list(range(n1 + 1))  # nothing after the move
    assert ms.list_deltas(ms.version_dir(store, NAME, v2)) == [0]
    in_v1, in_v2 = _delta_signs(store, v1, n1), _delta_signs(store, v2, 0)
    assert in_v1 <= a_signs and in_v2 <= b_signs and in_v1 - b_signs and in_v2 - a_signs

    # serving follows CURRENT (v2): v2's delta is applied, v1's is refused by a v2 shard
    served = serving_stores(store)
    assert {(s.version, s.delta_seq) for s in served} == {(v2, 0)}
    with pytest.raises(StoreError, match=f"belongs to version '{v1}', this shard serves '{v2}'"):
        served[0].apply_delta(ms.delta_dir(ms.version_dir(store, NAME, v1), n1))


def test_the_trainer_refuses_what_serving_refuses(store, watch, caplog):
    v1 = ms.current(store, NAME)
    with FollowTrainer(_cfg(store, watch, once=True)) as trainer:
        trainer.run(threading.Event())
        v2 = retrained(store, v1, dim=32)
        with pytest.raises(ms.IncompatibleVersion):
            ms.publish(store, NAME, v2)
        ms.layout.set_current(store, NAME, v2)  # forced past publish's gate
        assert trainer.run(threading.Event()).reloads == 0 and trainer.loaded.version == v1
    assert f"version {v2} cannot replace the served version {v1}: its embedding dim is 32" in caplog.text


def test_max_seconds_stops_without_a_delta_when_nothing_arrived(store, watch):
    t0 = time.monotonic()
    result = follow(_cfg(store, watch, max_seconds=0.5))
    assert result.deltas == [] and result.files == [] and time.monotonic() - t0 < 10


def test_cli_once(store, watch):
    shutil.copy(SAMPLE, watch / SAMPLE.name)
    (watch / f"{SAMPLE.name}.done").write_text("")
    # one delta, the final one, however slow the machine (the 2 s default interval could cut two)
    args = ["--follow", str(store / NAME), "--once", "--watch", str(watch), "--delta-interval-s", "3600"]
    proc = subprocess.run(
        [sys.executable, "-m", "recserve", "train", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["files"] == [SAMPLE.name] and summary["rows"] == 200 and len(summary["deltas"]) == 1
    bad = subprocess.run(
        [sys.executable, "-m", "recserve", "train", *args, "--epochs", "2", "--model", NAME],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )  # the model is the --follow directory's: --store and --model are the other mode's
    assert bad.returncode == 2 and "--epochs, --model do not apply to --follow" in bad.stderr


@pytest.mark.filterwarnings("ignore:.*torch.jit.load. is deprecated")
def test_a_delta_of_an_int8_version_is_cut_in_int8_and_served_within_its_bound(tmp_path, watch):
    """Deltas are written in the version's serving dtype (issue 44): the follower's delta of an
    int8 version is uint8 codes plus fp16 scales, and a serving shard that maps the version and
    applies it answers the trained rows within int8's bound."""
    from model_store.quant import error_bound
    from model_store.shards import read_shard, shard_dirs
    from serving.ps.follow import Follower
    from serving.ps.mapped import MappedTableShard
    from serving.ps.shard import TableShardConfig
    from serving.ps.spec import TableSpec
    from training.config import train_table

    store = tmp_path / "store"
    train(TrainConfig(store=str(store), model=NAME, epochs=1, limit=2000, inprocess_ps=True, publish=True,
                      progress=False, curve=str(tmp_path / "c.svg"), table=train_table(serving_dtype="int8")))  # fmt: skip
    shutil.copy(SAMPLE, watch / SAMPLE.name)
    with FollowTrainer(_cfg(store, watch, once=True)) as trainer:
        ((version, seq),) = trainer.run(threading.Event()).deltas
        signs = file_signs(store, SAMPLE)
        trained_rows = lookup(trainer.loaded.cluster.stores, signs)
    vdir = ms.version_dir(store, NAME, version)
    for part in shard_dirs(ms.delta_dir(vdir, seq)):
        data = read_shard(part)
        assert data.meta.row_dtype == "int8" and data.rows.dtype == np.uint8 and data.qparams is not None
    manifest = ms.read_manifest(vdir)
    served = [MappedTableShard(TableShardConfig(table=TableSpec(dim=manifest.dim), shard=i, num_shards=manifest.num_shards))
              for i in range(manifest.num_shards)]  # fmt: skip
    for s in served:
        Follower(s, ms.model_dir(store, NAME)).poll()
    assert {(s.version, s.delta_seq) for s in served} == {(version, seq)}
    assert {s.served.base.dtype for s in served} == {"int8"}
    got = lookup(served, signs)
    assert (np.abs(got - trained_rows) <= error_bound(trained_rows)[:, None]).all()


def test_a_taken_metrics_port_stops_the_trainer_with_a_clear_error(store, watch):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["--follow", str(store / NAME), "--once", "--watch", str(watch), "--metrics-port", str(port)]
        proc = subprocess.run([sys.executable, "-m", "recserve", "train", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    assert f"cannot serve /metrics on 127.0.0.1:{port} (--metrics-port)" in proc.stderr
    assert "Traceback" not in proc.stderr
