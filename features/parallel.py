"""File -> CompactBatch on every core: a source cut into disjoint parts, one process per part.

Parts: an uncompressed text file is cut into byte ranges of about ``part_bytes``, each starting
at a line start (a part reads its range into memory and streams it through Arrow's CSV reader);
a Parquet file into runs of row groups; a gzip file is one part (it cannot be entered midway).
Worker processes read, convert and transform their part (``features.stream``,
``features.transform``) and send the CompactBatches back; the parent yields them in file order
with at most ``2 * workers`` parts in flight, so memory stays bounded.

    for batch in batches("big.tsv", schema, ReadOptions(numeric_dense=True), 4096, workers=2): ...
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from features.batch import CompactBatch
from features.schema import Schema
from features.stream import FileFormat, ReadOptions, expand, schema_columns, sniff, to_table
from features.transform import Table, transform


@dataclass(frozen=True)
class Part:
    """A disjoint piece of one file: bytes [start, stop) of text, or row groups [start, stop)."""

    path: Path
    fmt: FileFormat
    start: int
    stop: int
    names: tuple[str, ...] = ()  # the text file's column names (from its header or the schema)


def parts(source: str | Path, schema: Schema, options: ReadOptions, part_bytes: int = 32 << 20) -> list[Part]:
    out = []
    for path in expand(source):
        size = path.stat().st_size
        if size == 0:
            continue
        fmt = sniff(path, schema, options.format)
        if fmt.kind == "parquet":
            import pyarrow.parquet as pq

            groups = pq.ParquetFile(path).num_row_groups
            per = max(1, round(groups * part_bytes / size))
            out += [Part(path, fmt, g, min(g + per, groups)) for g in range(0, groups, per)]
            continue
        with open(path, "rb") as f:
            header = f.readline() if fmt.header else b""
        names = tuple(header.decode().rstrip("\r\n").split(fmt.delimiter)) if fmt.header else fmt.columns
        if path.suffix == ".gz":
            out.append(Part(path, fmt, 0, size, names))
            continue
        cuts = sorted({_line_start(path, c) for c in range(len(header), size, part_bytes)} | {size})
        out += [Part(path, fmt, a, b, names) for a, b in zip(cuts, cuts[1:], strict=False)]
    return out


def _line_start(path: Path, offset: int) -> int:
    """The first line start at or after ``offset`` (a line start itself stays)."""
    if offset == 0:
        return 0
    with open(path, "rb") as f:
        f.seek(offset - 1)
        f.readline()
        return f.tell()


def part_tables(part: Part, schema: Schema, options: ReadOptions) -> Iterator[Table]:
    """The Tables of one part (the columns the schema uses)."""
    import pyarrow as pa

    include = list(schema_columns(schema))
    numeric = frozenset(s.column for s in schema.dense) if options.numeric_dense else frozenset()
    where = f"{part.path} [{part.start}:{part.stop}]"
    if part.fmt.kind == "parquet":
        import pyarrow.parquet as pq

        groups = list(range(part.start, part.stop))
        f = pq.ParquetFile(part.path)
        cols = [c for c in include if c in f.schema_arrow.names]
        batches = f.iter_batches(batch_size=options.batch_rows, row_groups=groups, columns=cols)
    elif part.path.suffix == ".gz":
        batches = _csv(str(part.path), part, options, include, skip_header=part.fmt.header)
    else:
        with open(part.path, "rb") as f:
            f.seek(part.start)
            data = f.read(part.stop - part.start)
        batches = _csv(pa.BufferReader(data), part, options, include, skip_header=False)
    for batch in batches:
        yield to_table(batch, numeric, where)


def _csv(source, part: Part, options: ReadOptions, include: list[str], skip_header: bool):
    import pyarrow as pa
    import pyarrow.csv as pacsv

    return pacsv.open_csv(
        source,
        read_options=pacsv.ReadOptions(
            column_names=list(part.names), skip_rows=int(skip_header), block_size=options.block_size
        ),
        parse_options=pacsv.ParseOptions(delimiter=part.fmt.delimiter, quote_char=False),
        convert_options=pacsv.ConvertOptions(
            column_types={c: pa.string() for c in part.names},
            include_columns=[c for c in include if c in part.names],
        ),
    )


def transform_part(part: Part, schema: Schema, options: ReadOptions, batch_rows: int) -> list[CompactBatch]:
    """One part as CompactBatches of ``batch_rows`` rows (the last may be shorter)."""
    out = []
    for t in part_tables(part, schema, options):
        for a in range(0, t.num_rows, batch_rows):
            b = min(a + batch_rows, t.num_rows)
            out.append(transform(Table({k: v[a:b] for k, v in t.columns.items()}, b - a), schema))
    return out


def batches(
    source: str | Path,
    schema: Schema,
    options: ReadOptions,
    batch_rows: int,
    workers: int = 0,
    pool: Executor | None = None,
    part_bytes: int = 32 << 20,
) -> Iterator[CompactBatch]:
    """Every row of ``source`` as CompactBatches, made by ``workers`` processes (0: one per CPU)
    or the given pool, in file order. A batch does not span two chunks."""
    own = pool is None
    pool = pool or ProcessPoolExecutor(workers or os.cpu_count() or 1)
    n = getattr(pool, "_max_workers", workers or 1)
    todo = iter(parts(source, schema, options, part_bytes))
    window: collections.deque = collections.deque()
    try:
        while True:
            while len(window) < 2 * n and (part := next(todo, None)) is not None:
                window.append(pool.submit(transform_part, part, schema, options, batch_rows))
            if not window:
                return
            yield from window.popleft().result()
    finally:
        for f in window:
            f.cancel()
        if own:
            pool.shutdown()
