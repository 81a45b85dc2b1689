"""Ranks following one stream (training/follow/ranks.py), without Kafka or torchrun: each rank's
parts of the source, the rounds and the vote at a look (a cut, the end, a move to the version rank
0 saw CURRENT name), what a rank sends rank 0 at a cut (``take_share``) and what rank 0 makes of
every rank's (``merge_shares``: one delta record with every rank's offsets, keys, counts and
window), and the cut itself in a one-process gloo group (written and committed; nothing to write;
refused, and then no rank commits). tests/training/follow/test_ranks_hosts.py runs a job of two
ranks on two hosts."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch.distributed as dist

import model_store as ms
from model_store.deltas import read_delta, read_keys
from serving.ps.shard import TableShard, TableShardConfig
from serving.ps.spec import TableSpec
from training.follow.book import StreamBook
from training.follow.ranks import Ranks, Round, cut_together, merge_shares, take_share
from training.sources import TICK, Part
from training.sources.ledger import Ledger

SOURCE = "kafka://b/samples"


def _book() -> StreamBook:
    return StreamBook(SOURCE, keyed=True, window_s=3600.0)


def _trained(
    book: StreamBook, keys: list[bytes], labels: list[float], scores: list[float], dups: int = 0
) -> None:
    """``keys`` trained by ``book``'s rank (scored ``scores`` first), ``dups`` dropped beside them."""
    book.add_keys(np.array(keys), np.full(len(keys), 1.7e9))
    book.rows(len(keys))
    book.progressive.add(np.array(labels, np.float32), np.array(scores, np.float32))
    book.final.add(np.array(keys), np.zeros(len(keys), np.uint8), np.full(len(keys), 1.7e9),
                   np.array(labels, np.float32), np.array(scores, np.float32))  # fmt: skip
    book.total.duplicates += dups


def test_one_process_is_rank_0_of_1_and_its_rounds_end_with_its_source(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    job = Ranks.join()
    assert (job.rank, job.world, job.done) == (0, 1, False)
    assert list(job.rounds(iter(["a", "b"]))) == ["a", "b"] and job.done  # type: ignore[arg-type]


def test_a_rank_whose_source_ended_keeps_taking_part_in_the_rounds():
    job = Ranks(rank=1, world=2)
    rounds = job.rounds(iter(["a"]))  # type: ignore[arg-type]
    assert next(rounds) == "a" and not job.done
    assert list(itertools.islice(rounds, 3)) == [TICK] * 3 and job.done  # until every rank ends


def test_a_rank_takes_the_parts_whose_number_is_its_rank_modulo_the_world():
    parts = [Part(f"samples/{i}", i) for i in range(5)]
    shares = []
    for rank in range(2):
        job = Ranks(rank=rank, world=2)
        job.take(parts)
        shares.append(job.units)
    assert shares == [{"samples/0", "samples/2", "samples/4"}, {"samples/1", "samples/3"}]


@pytest.mark.parametrize(
    ("cut_due", "done", "stopped", "outcome"),
    [(False, False, False, (False, False)), (True, False, False, (True, False)),
     (False, True, False, (False, True)), (True, False, True, (True, True))],
)  # fmt: skip
def test_a_look_cuts_when_rank_0_is_due_and_ends_when_every_rank_is_done_or_one_stopped(
    cut_due, done, stopped, outcome
):
    job = Ranks(done=done)
    assert job.look(cut_due, stopped) == Round(*outcome, version=None)


def test_a_look_moves_every_rank_to_the_version_rank_0_saw_current_name():
    assert Ranks().look(False, False, "2") == Round(cut=False, end=False, version="2")


def test_rank_0_sends_only_its_positions_its_book_is_the_jobs():
    book = _book()
    _trained(book, [b"a", b"b"], [1, 0], [0.9, 0.2], dups=3)
    share = take_share(book, {"samples/0": 7}, True, rank=0)
    assert share.positions == {"samples/0": 7} and share.changed
    assert (len(share.keys), len(share.labels), share.rows, share.duplicates) == (0, 0, 0, 0)
    counts, keys, _ = book.since_cut()  # still rank 0's to write
    assert (counts.rows, counts.duplicates, sorted(keys.tolist())) == (2, 3, [b"a", b"b"])


def test_another_rank_sends_what_it_trained_since_the_cut_and_marks_it_cut():
    book = _book()
    _trained(book, [b"c", b"dd"], [0, 1], [0.3, 0.6], dups=1)
    book.total.refused += 2
    share = take_share(book, {"samples/1": 5}, True, rank=1)
    assert sorted(share.keys.tolist()) == [b"c", b"dd"] and len(share.ts) == 2
    assert share.labels.tolist() == [0, 1] and share.scores.tolist() == pytest.approx([0.3, 0.6])
    assert (share.rows, share.duplicates, share.refused) == (2, 1, 2)
    # sent: the next share starts from nothing, and its window is not scored here again
    counts, keys, _ = book.since_cut()
    assert (counts.rows, counts.duplicates, counts.refused, len(keys)) == (0, 0, 0, 0)
    assert book.progressive.close_window().samples == 0
    assert len(book.keys) == 2  # its own dedupe still knows them


def test_rank_0_writes_one_record_of_every_ranks_offsets_keys_counts_and_window(tmp_path):
    books = [_book(), _book()]
    _trained(books[0], [b"a", b"b"], [1, 0], [0.9, 0.4], dups=1)
    _trained(books[1], [b"c"], [1], [0.1], dups=2)
    shares = [take_share(b, {f"samples/{r}": 10 + r}, True, r) for r, b in enumerate(books)]

    positions = merge_shares(books[0], shares)

    assert positions == {"samples/0": 10, "samples/1": 11}
    ddir = tmp_path / "v1" / "deltas" / "0"
    ddir.mkdir(parents=True)
    books[0].write(ddir, positions)
    record = read_delta(ddir)
    assert record is not None and record.positions == positions
    assert (record.samples, record.duplicates) == (3, 3)
    assert record.auc == pytest.approx(0.5)  # 1 (0.9) > 0 (0.4) but not > 1 (0.1): one of two pairs
    assert sorted(read_keys(ddir, record)[0].tolist()) == [b"a", b"b", b"c"]
    assert books[0].total.rows == 3
    final = books[0].final.figures()  # rank 0's figures against the final labels are the job's
    assert (final["samples"], final["auc"]) == (3, pytest.approx(0.5))
    assert books[1].final.take().tally.samples == 0  # sent once: the next part starts from nothing


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A gloo process group of this process alone (rank 0 of 1): gather and broadcast run."""
    if dist.is_initialized():
        pytest.skip("a process group is already joined in this process")
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class _Cluster:
    """The job's shards, as ``cut_together`` uses them: one store, dumped as a delta."""

    def __init__(self, store: TableShard):
        self.store = store

    def dump(self, directory, delta: bool = False) -> None:
        assert delta
        self.store.dump_delta(directory)


@pytest.fixture
def version(tmp_path):
    """(version directory, the job's shards over it): one shard of dim 4 with rows for signs 1-9."""
    store = TableShard(TableShardConfig(table=TableSpec(dim=4, capacity=64)))
    store.lookup(np.arange(1, 10, dtype=np.uint64), insert=True)
    vdir = tmp_path / "store" / "m" / "1"
    store.dump(vdir / "embeddings")
    store.cut_delta()  # the rows above are the version's: the next delta holds what changes after
    return vdir, _Cluster(store)


def test_a_cut_together_writes_the_delta_with_the_record_and_then_commits(group, version, tmp_path):
    vdir, cluster = version
    cluster.store.assign(np.array([3], np.uint64), np.ones((1, 4), np.float32))  # a row trained
    job, book, ledger = Ranks(), _book(), Ledger(tmp_path / "ledger.json")
    job.take([Part("samples/0", 0)])
    _trained(book, [b"a"], [1], [0.5])
    ledger.advance("samples/0", 12)

    assert cut_together(job, cluster, vdir, book, ledger, changed=True) == 0

    ddir = ms.delta_dir(vdir, 0)
    record = read_delta(ddir)
    assert (ddir / ms.SUCCESS).is_file() and record is not None
    assert [np.load(p / "signs.npy").tolist() for p in ddir.glob("shard-*")] == [[3]]  # the row trained
    assert (record.positions, record.samples) == ({"samples/0": 12}, 1)
    assert job.seq == 0 and Ledger(ledger.path).row("samples/0") == 12  # committed once published


def test_a_cut_with_nothing_trained_and_nothing_read_writes_nothing(group, version, tmp_path):
    vdir, cluster = version
    job, ledger = Ranks(), Ledger(tmp_path / "ledger.json")
    assert cut_together(job, cluster, vdir, _book(), ledger, changed=False) is None
    assert ms.list_deltas(vdir) == [] and job.seq == -1


def test_a_cut_rank_0_cannot_write_fails_every_rank_and_none_commits(group, version, tmp_path):
    vdir, cluster = version
    theirs = ms.delta_dir(vdir, 0)  # another writer finished delta 0 of this version
    theirs.mkdir(parents=True)
    ms.mark_done(theirs)
    job, book, ledger = Ranks(), _book(), Ledger(tmp_path / "ledger.json")
    job.take([Part("samples/0", 0)])
    _trained(book, [b"a"], [1], [0.5])
    ledger.advance("samples/0", 12)

    with pytest.raises(RuntimeError, match="rank 0 could not cut the delta: ModelStoreError: .*someone else"):
        cut_together(job, cluster, vdir, book, ledger, changed=True)

    assert not ledger.path.exists() and Ledger(ledger.path).row("samples/0") == 0 and job.seq == -1
