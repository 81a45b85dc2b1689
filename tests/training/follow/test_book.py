"""The streaming trainer's book (training/follow/book.py): each delta's key file holds the keys
trained since the delta before, a whole-window file comes when due, and the window reads back whole
(on resume too, and only from a record of the same source); samples whose key was trained are
dropped and counted; each delta records its own counts and progressive window; a keyed stream that
read on is due a delta; the metrics say what the book counts."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

import numpy as np
import pytest

import model_store as ms
from model_store.deltas import last_record, read_delta, read_keys
from tests.helpers import free_port
from training.follow import book as stream_book
from training.follow.book import StreamBook
from training.sources.ledger import Ledger


def _cut(book: StreamBook, vdir, seq: int, keys: list[bytes], t: float):
    book.add_keys(np.array(keys), np.full(len(keys), t))
    ddir = ms.delta_dir(vdir, seq)
    ddir.mkdir(parents=True)
    book.write(ddir, {"t/0": seq + 1})
    ms.mark_done(ddir)
    record = read_delta(ddir)
    assert record is not None
    return ddir, record


def test_a_delta_holds_only_its_new_keys_and_reads_back_the_window(tmp_path, monkeypatch):
    monkeypatch.setattr(stream_book, "WHOLE_MIN_KEYS", 4)
    vdir = tmp_path / "v1"
    book = StreamBook("kafka://b/t", keyed=True, window_s=10.0)
    ddir, first = _cut(book, vdir, 0, [b"a", b"b"], 1.0)
    assert (first.keys_count, first.keys_after) == (2, "")  # the first: the whole window
    ddir, second = _cut(book, vdir, 1, [b"c"], 2.0)
    assert (second.keys_count, second.keys_after, second.keys_links) == (1, "../0", 1)
    assert read_keys(ddir, second)[0].tolist() == [b"a", b"b", b"c"]

    # a restarted trainer goes on from the last record, adding to its chain
    again = StreamBook("kafka://b/t", keyed=True, window_s=10.0)
    again.resume(vdir, Ledger(tmp_path / "ledger.json"))
    assert len(again.keys) == 3
    ddir, third = _cut(again, vdir, 2, [b"d"], 12.0)  # a and b: out of the window (< 2.0)
    assert (third.keys_count, third.keys_after) == (1, "../1")
    assert read_keys(ddir, third)[0].tolist() == [b"c", b"d"]
    # the keys added since the whole file reach those it held: the whole window, trimmed (c: 2.0 < 3.0)
    ddir, fourth = _cut(again, vdir, 3, [b"e", b"f"], 13.0)
    assert (fourth.keys_after, fourth.keys_links, fourth.keys_count) == ("", 0, 3)
    assert read_keys(ddir, fourth)[0].tolist() == [b"d", b"e", b"f"]
    assert last_record(vdir) == (fourth, ddir)


@pytest.mark.parametrize("every", [1, 2])
def test_a_whole_window_file_at_least_every_whole_every_files(tmp_path, monkeypatch, every):
    monkeypatch.setattr(stream_book, "WHOLE_EVERY", every)
    book = StreamBook("kafka://b/t", keyed=True, window_s=100.0)
    links = [_cut(book, tmp_path, seq, [b"k%d" % seq], seq)[1].keys_links for seq in range(5)]
    assert links == ([0, 1, 0, 1, 0] if every == 1 else [0, 1, 2, 0, 1, 2][:5])


@dataclass
class _Keyed:
    """A keyed batch as the book reads it: keys and their sample times."""

    keys: np.ndarray
    ts: np.ndarray

    @property
    def kinds(self) -> np.ndarray:
        return np.zeros(len(self.keys), np.uint8)  # first labels


def _keyed(*keys: bytes, t: float = 1.0) -> _Keyed:
    return _Keyed(np.array(keys), np.full(len(keys), t))


def test_admit_drops_keys_trained_already_and_counts_them_with_the_refused():
    book = StreamBook("kafka://b/t", keyed=True, window_s=10.0)
    first = _keyed(b"a", b"b")
    assert book.admit(first, refused=1) is None  # all new: every row trains
    book.trained(first, None, np.array([1, 0], np.float32), np.array([0.8, 0.3], np.float32))
    again = _keyed(b"b", b"c", b"c", b"a", b"d")
    rows = book.admit(again, refused=2)
    assert rows is not None and rows.tolist() == [1, 4]  # c once, d; b and a trained already
    book.trained(again, rows, np.array([0, 1], np.float32), np.array([0.4, 0.6], np.float32))
    assert (book.total.rows, book.total.duplicates, book.total.refused) == (4, 3, 3)
    counts, keys, _ = book.since_cut()
    assert sorted(keys.tolist()) == [b"a", b"b", b"c", b"d"] and counts.rows == 4
    assert book.progressive.total().samples == 4


def test_the_keys_since_the_cut_keep_their_full_width():
    book = StreamBook("kafka://b/t", keyed=True, window_s=10.0)
    book.add_keys(np.array([b"a"]), np.array([1.0]))
    book.add_keys(np.array([b"longer-key"]), np.array([2.0]))
    _, keys, ts = book.since_cut()
    assert keys.tolist() == [b"a", b"longer-key"] and ts.tolist() == [1.0, 2.0]


def test_each_delta_records_its_own_counts_and_window(tmp_path):
    book = StreamBook("kafka://b/t", keyed=True, window_s=10.0)
    keyed = _keyed(b"a", b"b", b"c")
    book.admit(keyed, refused=0)
    book.trained(keyed, None, np.array([1, 0, 1], np.float32), np.array([0.9, 0.1, 0.8], np.float32))
    ddir = tmp_path / "0"
    ddir.mkdir()
    book.write(ddir, {"t/0": 3})
    first = read_delta(ddir)
    assert first is not None and (first.samples, first.duplicates, first.auc) == (3, 0, 1.0)
    book.admit(keyed, refused=0)  # all three again: duplicates only
    ddir = tmp_path / "1"
    ddir.mkdir()
    book.write(ddir, {"t/0": 6})
    second = read_delta(ddir)
    assert second is not None and (second.samples, second.duplicates, second.auc) == (0, 3, None)
    assert [w.samples for w in book.windows] == [3]  # a window of no samples is no score


def test_a_keyed_stream_moved_when_it_read_past_what_the_last_delta_recorded(tmp_path):
    book = StreamBook("kafka://b/t", keyed=True, window_s=10.0)
    assert not book.moved({}) and book.moved({"t/0": 5})
    ddir = tmp_path / "0"
    ddir.mkdir()
    book.write(ddir, {"t/0": 5})
    assert not book.moved({"t/0": 5}) and book.moved({"t/0": 5, "t/1": 1})
    files = StreamBook("watch://in", keyed=False, window_s=10.0)  # files: no offsets to keep
    assert not files.moved({"a.csv": 100})


def test_a_record_of_another_source_is_not_resumed(tmp_path):
    vdir = tmp_path / "v1"
    book = StreamBook("kafka://b/old-topic", keyed=True, window_s=10.0)
    _cut(book, vdir, 0, [b"a"], 1.0)
    ledger = Ledger(tmp_path / "ledger.json")
    other = StreamBook("kafka://b/new-topic", keyed=True, window_s=10.0)
    other.resume(vdir, ledger)
    assert ledger.positions() == {} and len(other.keys) == 0 and other.moved({"t/0": 1})
    same = StreamBook("kafka://b/old-topic", keyed=True, window_s=10.0)
    same.resume(vdir, ledger)
    assert ledger.positions() == {"t/0": 1} and len(same.keys) == 1 and not same.moved({"t/0": 1})


def test_the_largest_lag_seen_is_kept():
    book = StreamBook("kafka://b/t", keyed=True, window_s=10.0)
    for lag in (5, None, 12, 3):
        book.lag(lag)
    assert book.total.max_lag == 12


def test_the_metrics_count_what_the_book_counts(tmp_path):
    port = free_port()
    book = StreamBook("kafka://b/t", keyed=True, window_s=10.0)
    book.serve_metrics(port, "127.0.0.1")
    try:
        keyed = _keyed(b"a", b"b")
        book.admit(keyed, refused=1)
        book.trained(keyed, None, np.array([1, 0], np.float32), np.array([0.7, 0.2], np.float32))
        book.admit(_keyed(b"a"), refused=0)
        book.lag(9)
        ddir = tmp_path / "0"
        ddir.mkdir()
        book.write(ddir, {"t/0": 4})
        book.cut_took(0.03)
        book.published(0.3)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        book.close()
    for line in ("recserve_follow_samples_total 2.0", "recserve_follow_duplicates_total 1.0",
                 "recserve_follow_refused_total 1.0", "recserve_follow_deltas_total 1.0",
                 'recserve_follow_offset{unit="t/0"} 4.0', "recserve_follow_lag_samples 9.0",
                 "recserve_follow_progressive_auc 1.0", "recserve_follow_delta_cut_seconds_count 1.0",
                 'recserve_follow_delta_cut_seconds_bucket{le="0.025"} 0.0',
                 'recserve_follow_delta_cut_seconds_bucket{le="0.05"} 1.0',
                 'recserve_follow_delta_publish_seconds_bucket{le="0.25"} 0.0',
                 'recserve_follow_delta_publish_seconds_bucket{le="0.5"} 1.0'):  # fmt: skip
        assert line in metrics, line


def test_a_window_of_one_label_keeps_the_last_auc_and_is_counted(tmp_path):
    """A delta whose samples are all negatives has no AUC: the gauge a guard reads keeps the last
    AUC (it read NaN before) and the one-class counter says why it did not move."""
    port = free_port()
    book = StreamBook("kafka://b/t", keyed=True, window_s=10.0)
    book.serve_metrics(port, "127.0.0.1")
    try:
        for seq, (keys, labels, scores) in enumerate([
            ((b"a", b"b"), [1, 0], [0.7, 0.2]),  # AUC 1.0
            ((b"c", b"d"), [0, 0], [0.6, 0.1]),  # negatives only
        ]):  # fmt: skip
            keyed = _keyed(*keys)
            book.admit(keyed, refused=0)
            book.trained(keyed, None, np.array(labels, np.float32), np.array(scores, np.float32))
            ddir = tmp_path / str(seq)
            ddir.mkdir()
            book.write(ddir, {"t/0": 2 * seq + 2})
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        book.close()
    assert "recserve_follow_progressive_auc 1.0" in metrics and "NaN" not in metrics
    assert "recserve_follow_progressive_one_class_total 1.0" in metrics


def test_a_taken_metrics_port_is_refused_naming_the_address():
    import socket

    from serving.rpc.metrics import MetricsPortError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            MetricsPortError, match=f"cannot serve /metrics on 127.0.0.1:{port} .--metrics-port."
        ):
            StreamBook("kafka://b/t", keyed=True, window_s=10.0).serve_metrics(port, "127.0.0.1")
