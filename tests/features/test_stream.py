"""Streaming readers: chunked reads equal whole reads; every format, compression and source form;
formats declared or inferred (never from the schema's name); clear errors naming file and line."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from features import stream
from features.codec import encode
from features.schema import load_schema
from features.stream import ReadOptions
from features.transform import FeatureError, Table, transform

CRITEO = load_schema("data/schemas/criteo.yaml")
TSV = Path("data/criteo/wide_resdnn_criteo_train.tsv")


def plain(path: Path, sep: str = "\t") -> Table:
    """The oracle, independent of the reader under test: lines split by hand, every value the
    string the file holds; a headerless file gets the schema's column order, a .csv its header."""
    lines = path.read_text().splitlines()
    header = path.suffix == ".csv"
    names = lines[0].split(sep) if header else list(stream.schema_columns(CRITEO))
    fields = [line.split(sep) for line in lines[header:]]
    return Table({n: np.array([f[i] for f in fields], dtype=str) for i, n in enumerate(names)}, len(fields))


WHOLE = plain(TSV)
SMALL = ReadOptions(block_size=16 << 10)  # ~70 rows a chunk: the 8k-row file is ~110 chunks


def rows(table: Table, a: int, b: int) -> Table:
    return Table({k: v[a:b] for k, v in table.columns.items()}, b - a)


def assert_same_rows(tables: list[Table], whole: Table = WHOLE, start: int = 0) -> int:
    """Each chunk transforms to exactly the bytes of the same rows of the whole file."""
    at = start
    for t in tables:
        assert encode(transform(t, CRITEO)) == encode(transform(rows(whole, at, at + t.num_rows), CRITEO))
        at += t.num_rows
    return at - start


@pytest.mark.parametrize("numeric", [False, True])
def test_a_file_larger_than_a_chunk_gives_the_batches_of_the_whole_file(numeric):
    options = ReadOptions(block_size=16 << 10, numeric_dense=numeric)
    tables = list(stream.stream(TSV, CRITEO, options))
    assert len(tables) > 50 and max(t.num_rows for t in tables) < 200  # bounded chunks
    assert assert_same_rows(tables) == WHOLE.num_rows == 8000
    if numeric:
        assert tables[0].columns["I1"].dtype == np.float64 and tables[0].columns["C1"].dtype.kind == "U"
    else:  # the same strings the whole-file reader gives
        merged = stream.concat(tables)
        for c, col in WHOLE.columns.items():
            np.testing.assert_array_equal(merged.columns[c], col)


def test_limit_and_rank_parts():
    assert assert_same_rows(list(stream.stream(TSV, CRITEO, SMALL, limit=1234))) == 1234
    world, seen = 3, []
    for rank in range(world):
        for t in stream.stream(TSV, CRITEO, SMALL, limit=5000, part=(rank, world)):
            seen.append(t)
    # rank r holds the pieces i with i % 3 == r: together every row exactly once
    labels = np.concatenate([t.columns["C3"] for t in seen])
    assert len(labels) == 5000
    got = sorted(
        zip(*(np.concatenate([t.columns[c] for t in seen]) for c in ("C1", "C3", "I5")), strict=True)
    )
    want = sorted(zip(*(WHOLE.columns[c][:5000] for c in ("C1", "C3", "I5")), strict=True))
    assert got == want
    # rank 1 of 3: pieces 1 and 4 of 1024 rows, the second cut at the limit
    rank1 = stream.concat(list(stream.stream(TSV, CRITEO, SMALL, limit=5000, part=(1, 3))))
    assert stream.PIECE_ROWS == 1024 and rank1.num_rows == 1024 + 904
    assert_same_rows([rows(rank1, 0, 1024)], start=1024)
    assert_same_rows([rows(rank1, 1024, 1928)], start=4096)


def test_headerless_csv_gzip_parquet_glob_and_directory(tmp_path):
    text = TSV.read_text()
    (tmp_path / "plain.csv").write_text(text.replace("\t", ","))  # headerless CSV: schema's columns
    with gzip.open(tmp_path / "zipped.tsv.gz", "wt") as f:
        f.write(text)
    _write_parquet(WHOLE, tmp_path / "typed.parquet", row_group_size=1000)
    for name in ("plain.csv", "zipped.tsv.gz", "typed.parquet"):
        assert assert_same_rows(list(stream.stream(tmp_path / name, CRITEO, SMALL))) == 8000, name

    parts = tmp_path / "parts"
    parts.mkdir()
    lines = text.splitlines(keepends=True)
    (parts / "part-0.tsv").write_text("".join(lines[:3000]))
    with gzip.open(parts / "part-1.tsv.gz", "wt") as f:
        f.write("".join(lines[3000:5000]))
    _write_parquet(rows(WHOLE, 5000, 8000), parts / "part-2.parquet", row_group_size=700)
    (parts / "_SUCCESS").write_text("")  # markers and hidden files are not data
    (parts / ".part-3.tsv.tmp").write_text("garbage")
    (parts / "part-2.parquet.done").write_text("")
    assert stream.expand(parts) == [parts / "part-0.tsv", parts / "part-1.tsv.gz", parts / "part-2.parquet"]
    assert assert_same_rows(list(stream.stream(parts, CRITEO, SMALL))) == 8000
    assert assert_same_rows(list(stream.stream(f"{parts}/part-*", CRITEO, SMALL, limit=4000))) == 4000


def test_header_is_detected_or_declared(tmp_path):
    sample = Path("data/criteo/deepctr_criteo_sample.csv")
    with_header = list(stream.stream(sample, CRITEO))
    assert sum(t.num_rows for t in with_header) == 200
    assert_same_rows(with_header, plain(sample, ","))
    # a .tsv with a header line, and an unknown suffix (sniffed: tab-separated)
    header = "\t".join(stream.schema_columns(CRITEO)) + "\n"
    (tmp_path / "h.tsv").write_text(header + "".join(TSV.read_text().splitlines(keepends=True)[:300]))
    (tmp_path / "data.log").write_text("".join(TSV.read_text().splitlines(keepends=True)[:300]))
    assert assert_same_rows(list(stream.stream(tmp_path / "h.tsv", CRITEO))) == 300
    assert assert_same_rows(list(stream.stream(tmp_path / "data.log", CRITEO))) == 300
    # declared: the header line taken as data fails on the label; the format beats the suffix
    with pytest.raises(FeatureError, match="'I1': not a number"):
        for t in stream.stream(tmp_path / "h.tsv", CRITEO, ReadOptions(format="tsv:noheader")):
            transform(t, CRITEO)
    (tmp_path / "tabs.csv").write_text("".join(TSV.read_text().splitlines(keepends=True)[:300]))
    with pytest.raises(FeatureError, match="line 1 has 1 fields"):
        list(stream.stream(tmp_path / "tabs.csv", CRITEO))
    assert (
        assert_same_rows(list(stream.stream(tmp_path / "tabs.csv", CRITEO, ReadOptions(format="tsv")))) == 300
    )
    with pytest.raises(ValueError, match="data format"):
        ReadOptions(format="xlsx")


def test_a_malformed_line_names_file_and_line(tmp_path):
    lines = TSV.read_text().splitlines(keepends=True)[:3000]
    lines[2499] = lines[2499].replace("\t", "", 1)  # line 2500 lacks a field
    bad = tmp_path / "bad.tsv"
    bad.write_text("".join(lines))
    with pytest.raises(FeatureError, match=r"bad\.tsv: line 2500: expected 40 fields, got 39"):
        list(stream.stream(bad, CRITEO, SMALL))
    header = Path("data/criteo/deepctr_criteo_sample.csv").read_text().splitlines(keepends=True)
    header[7] = header[7].rstrip("\n") + ",extra\n"  # line 8, counting the header
    (tmp_path / "bad.csv").write_text("".join(header))
    with pytest.raises(FeatureError, match=r"bad\.csv: line 8: expected 40 fields, got 41"):
        list(stream.stream(tmp_path / "bad.csv", CRITEO))
    with pytest.raises(FeatureError, match="no such data file"):
        list(stream.stream(tmp_path / "missing.tsv", CRITEO))
    with pytest.raises(FeatureError, match="no data files"):
        list(stream.stream(f"{tmp_path}/*.parquet", CRITEO))


def test_numbers_arrow_refuses_are_parsed_as_transform_would(tmp_path):
    lines = TSV.read_text().splitlines(keepends=True)[:100]
    fields = lines[3].split("\t")
    fields[1] = " 7"  # numpy accepts surrounding blanks, Arrow does not
    lines[3] = "\t".join(fields)
    (tmp_path / "blank.tsv").write_text("".join(lines))
    strings = stream.read(tmp_path / "blank.tsv", CRITEO)
    numeric = stream.read(tmp_path / "blank.tsv", CRITEO, ReadOptions(numeric_dense=True))
    assert numeric.columns["I1"][3] == 7.0
    assert encode(transform(strings, CRITEO)) == encode(transform(numeric, CRITEO))
    fields[1] = "seven"
    lines[3] = "\t".join(fields)
    (tmp_path / "word.tsv").write_text("".join(lines))
    with pytest.raises(
        FeatureError, match=r"word\.tsv: rows 1\.\.100, column 'I1': row 4 of the chunk, 'seven'"
    ):
        stream.read(tmp_path / "word.tsv", CRITEO, ReadOptions(numeric_dense=True))


def test_text_beyond_ascii_and_nulls_convert_exactly():
    arr = pa.array(["05db9164", "", None, "é", "日本語", "x" * 40])
    want = np.array(["05db9164", "", "", "é", "日本語", "x" * 40])
    np.testing.assert_array_equal(stream.unicode_column(arr), want)
    np.testing.assert_array_equal(stream.unicode_column(arr.slice(0, 2)), want[:2])  # offset views
    np.testing.assert_array_equal(stream.unicode_column(pa.array(["", ""])), ["", ""])
    floats = stream.float_column(pa.array(["1", "", None, "2.5e3", "-0"]))
    np.testing.assert_array_equal(floats, [1.0, np.nan, np.nan, 2500.0, -0.0])


def _write_parquet(table: Table, path: Path, row_group_size: int) -> None:
    """Typed Parquet, as other tools write it: label and counts as nullable int64, IDs as strings."""
    cols = {}
    for name, col in table.columns.items():
        if name == "label" or name.startswith("I"):
            missing = col == ""
            ints = np.where(missing, "0", col).astype(np.int64)
            cols[name] = pa.array(ints, mask=missing)
        else:
            cols[name] = pa.array(col.tolist(), mask=col == "")
    pq.write_table(pa.table(cols), path, row_group_size=row_group_size)
