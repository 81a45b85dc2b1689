"""Training data as a stream: batches equal the whole-file batches (shuffle off), the shuffle
buffer only reorders, dense statistics from one pass equal the whole-file ones, rank parts."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from features import stream
from features.codec import encode
from features.schema import load_schema
from features.stream import ReadOptions
from features.transform import Table, dense_matrix, transform
from training import data

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = load_schema(ROOT / "data/schemas/criteo.yaml")
TRAIN = ROOT / "data/criteo/wide_resdnn_criteo_train.tsv"
SMALL = ReadOptions(block_size=16 << 10, numeric_dense=True)  # ~110 chunks of the 8k rows
WHOLE = ReadOptions(block_size=64 << 20)  # the whole file in one chunk


def test_streamed_batches_equal_the_whole_file_batches_without_shuffle():
    whole = [encode(b) for b in data.batches(stream.read(TRAIN, SCHEMA, WHOLE), SCHEMA, 128)]
    split = data.Split(TRAIN, SCHEMA, SMALL)
    streamed = [encode(b) for b in split.batches(128)]
    assert len(whole) == len(streamed) == 63 and whole == streamed
    assert [encode(b) for b in split.batches(128, steps=10)] == whole[:10]


def test_the_shuffle_buffer_reorders_rows_within_a_bounded_window():
    split = data.Split(TRAIN, SCHEMA, ReadOptions(block_size=16 << 10))  # strings: comparable rows
    ordered = data.concat(list(split.tables()))

    def mixed(seed: int, buffer: int) -> Table:
        return data.concat(list(data.shuffled(split.tables(), buffer, np.random.default_rng(seed))))

    a, b, c = mixed(0, 1000), mixed(0, 1000), mixed(1, 1000)
    key = ("C3", "C12", "I5", "label")

    def rows(t: Table) -> list:
        return list(zip(*(t.columns[k] for k in key), strict=True))

    assert rows(a) == rows(b) != rows(c)  # deterministic per seed
    assert sorted(rows(a)) == sorted(rows(ordered)) and rows(a) != rows(ordered)  # a permutation
    # a row goes out at most buffer + one chunk (~70) rows before its place: the window is bounded
    position: dict = {}
    for i, r in enumerate(rows(ordered)):
        position.setdefault(r, i)  # a repeated row: its first occurrence
    early = [position[r] - i for i, r in enumerate(rows(a))]
    assert 900 < max(early) <= 1000 + 100


def test_dense_statistics_from_one_streaming_pass_equal_the_whole_file_ones():
    whole = stream.read(TRAIN, SCHEMA, WHOLE)
    x = dense_matrix(transform(whole, SCHEMA), SCHEMA).astype(np.float64)
    scan = data.Split(TRAIN, SCHEMA, SMALL).scan()
    assert scan.rows == 8000
    stats = scan.stats(SCHEMA)
    np.testing.assert_allclose([stats[s.name][0] for s in SCHEMA.dense], x.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose([stats[s.name][1] for s in SCHEMA.dense], x.std(axis=0), rtol=1e-10)
    # rank parts merge to the same moments (DDP: every rank scans its part, all merge alike)
    parts = [data.Split(TRAIN, SCHEMA, SMALL, part=(r, 3)).scan() for r in range(3)]
    merged = parts[0].merge(parts[1]).merge(parts[2])
    assert [p.rows for p in parts] == [3072, 2880, 2048] and merged.rows == 8000
    np.testing.assert_allclose(merged.mean, scan.mean, rtol=1e-12)
    np.testing.assert_allclose(merged.m2, scan.m2, rtol=1e-10)


def test_the_format_comes_from_the_file_never_from_the_schema_name(tmp_path):
    """Any file used to be read as Criteo TSV when the schema was named "criteo"."""
    (tmp_path / "x.csv").write_text(TRAIN.read_text().replace("\t", ","))  # headerless CSV
    table = stream.read(tmp_path / "x.csv", SCHEMA, limit=100)
    assert SCHEMA.name == "criteo" and table.num_rows == 100
    want = stream.read(TRAIN, SCHEMA, limit=100)
    assert encode(transform(table, SCHEMA)) == encode(transform(want, SCHEMA))


def test_in_background_passes_items_and_errors_and_stops_early():
    assert list(data.in_background(iter(range(100)), depth=2)) == list(range(100))

    def failing():
        yield 1
        raise ValueError("bad chunk")

    with pytest.raises(ValueError, match="bad chunk"):
        list(data.in_background(failing()))
    for i in data.in_background(iter(range(10**9)), depth=2):  # leaving early stops the thread
        if i == 5:
            break
    assert not [t for t in threading.enumerate() if t.name == "data"]
