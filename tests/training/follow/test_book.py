"""The streaming trainer's book: each delta's key file holds the keys trained since the delta
before, a whole-window file comes when due, and the window reads back whole (on resume too)."""

from __future__ import annotations

import numpy as np
import pytest

import model_store as ms
from model_store.deltas import last_record, read_delta, read_keys
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
