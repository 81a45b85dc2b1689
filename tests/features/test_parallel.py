"""The parallel reader: disjoint parts that together hold every row once, in file order."""

from __future__ import annotations

import gzip
from pathlib import Path

import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from features import parallel, stream
from features.codec import encode
from features.schema import load_schema
from features.stream import ReadOptions
from features.transform import transform

CRITEO = load_schema("data/schemas/criteo.yaml")
TSV = Path("data/criteo/wide_resdnn_criteo_train.tsv")
OPTIONS = ReadOptions(block_size=16 << 10, numeric_dense=True)


def _all_rows(source, part_bytes: int) -> tuple[int, bytes]:
    ps = parallel.parts(source, CRITEO, OPTIONS, part_bytes=part_bytes)
    tables = [t for p in ps for t in parallel.part_tables(p, CRITEO, OPTIONS)]
    return len(ps), encode(transform(stream.concat(tables), CRITEO))


def test_parts_hold_every_row_once_in_every_format(tmp_path):
    want = encode(transform(stream.read(TSV, CRITEO, OPTIONS), CRITEO))
    n, got = _all_rows(TSV, part_bytes=100_000)  # ~20 byte ranges, cut at line starts
    assert n > 15 and got == want
    header = "\t".join(stream.schema_columns(CRITEO)) + "\n"
    (tmp_path / "h.tsv").write_text(header + TSV.read_text())
    assert _all_rows(tmp_path / "h.tsv", part_bytes=100_000)[1] == want
    with gzip.open(tmp_path / "z.tsv.gz", "wt") as f:
        f.write(TSV.read_text())
    assert _all_rows(tmp_path / "z.tsv.gz", part_bytes=100_000) == (1, want)
    table = pacsv.read_csv(TSV, read_options=pacsv.ReadOptions(column_names=list(stream.schema_columns(CRITEO))),
                           parse_options=pacsv.ParseOptions(delimiter="\t"))  # fmt: skip
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=500)
    n, got = _all_rows(tmp_path / "p.parquet", part_bytes=50_000)
    assert n > 4 and got == want


def test_batches_from_worker_processes_come_in_file_order():
    ps = parallel.parts(TSV, CRITEO, OPTIONS, part_bytes=300_000)
    want = [encode(b) for p in ps for b in parallel.transform_part(p, CRITEO, OPTIONS, 500)]
    got = [encode(b) for b in parallel.batches(TSV, CRITEO, OPTIONS, 500, workers=2, part_bytes=300_000)]
    assert len(ps) > 4 and got == want
