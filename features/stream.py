"""Streaming readers: data files of any size as a sequence of ``Table`` chunks in bounded memory.

Sources: a file, a directory (its files, sorted; names starting with '.' or '_' and ``*.done``
markers skipped) or a glob. Formats, per file:

- delimited text (TSV/CSV, optionally gzip): pyarrow's streaming CSV reader, ``block_size`` bytes
  at a time, no quoting (as the Criteo logs). With a header line its names are the columns;
  without one the columns are the schema's, in order: the label, then every slot's column (the
  Criteo TSV order: label, I1..I13, C1..C26);
- Parquet: ``ParquetFile.iter_batches``, ``batch_rows`` rows at a time, only the columns the
  schema uses.

The format is declared (``ReadOptions.format``: tsv, csv or parquet, optionally ``:header`` /
``:noheader``) or inferred from the file: the suffix (.parquet/.pq, .tsv/.txt, .csv, after .gz),
else the content (Parquet's magic bytes, a tab in the first line); a text file has a header when
its first line names a schema column and holds no number. Never from the schema's name.

Every value comes out as the string the file holds (numpy 'U', missing = "", Parquet values cast
to text), so ``transform`` gives the same CompactBatch as for the whole file read at once. With
``numeric_dense`` the dense slots' columns come out as float64 instead (NaN = missing), parsed by
Arrow: the same batches again, without numpy's slow string-to-float parse. The per-value work is
Arrow's and one compiled pass per chunk (``_ascii_ucs4``); nothing loops in Python per row.

Partitioning for data-parallel training: rows are numbered across the files in order and cut into
pieces of ``PIECE_ROWS``; rank ``r`` of ``w`` keeps the pieces ``i`` with ``i % w == r``.
"""

from __future__ import annotations

import glob
import gzip
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numba
import numpy as np
from numpy.typing import NDArray

from features.schema import Schema
from features.transform import FeatureError, Table

if TYPE_CHECKING:
    import pyarrow as pa

PIECE_ROWS = 1024  # rows per partition unit (rank r keeps pieces i with i % world == r)
TEXT_SUFFIXES = {".tsv": "\t", ".txt": "\t", ".csv": ","}
PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclass(frozen=True)
class ReadOptions:
    """How to read a data source."""

    format: str = "auto"
    """auto (per file, from suffix and content), tsv, csv or parquet; text formats may add
    ``:header`` or ``:noheader`` (default: detected from the first line)."""
    block_size: int = 4 << 20
    """Bytes of text parsed per chunk (decompressed bytes for gzip)."""
    batch_rows: int = 65536
    """Rows per chunk of a Parquet file."""
    numeric_dense: bool = False
    """Dense slot columns as float64 (NaN where missing) instead of strings."""

    def __post_init__(self) -> None:
        kind, _, header = self.format.partition(":")
        if kind not in ("auto", "tsv", "csv", "parquet") or header not in ("", "header", "noheader"):
            raise ValueError(
                f"data format must be auto, tsv, csv or parquet[:header|:noheader], not {self.format!r}"
            )
        if kind in ("auto", "parquet") and header:
            raise ValueError(f"data format {self.format!r}: a header applies to tsv and csv only")
        if self.block_size < 1024 or self.batch_rows < 1:
            raise ValueError("block_size must be >= 1024 bytes and batch_rows >= 1")


@dataclass(frozen=True)
class FileFormat:
    """One file's resolved format."""

    kind: str  # "text" or "parquet"
    delimiter: str = "\t"
    header: bool = False
    columns: tuple[str, ...] = ()  # headerless text: the names given to its fields


# --- sources and formats -------------------------------------------------------------------------
def expand(source: str | Path) -> list[Path]:
    """The data files of a file, directory or glob, sorted; an error when there are none."""
    s = str(source)
    if any(c in s for c in "*?["):
        files = [Path(p) for p in sorted(glob.glob(s, recursive=True)) if Path(p).is_file()]
    elif Path(s).is_dir():
        files = sorted(p for p in Path(s).iterdir() if p.is_file())
    elif Path(s).is_file():
        return [Path(s)]
    else:
        raise FeatureError(f"{s}: no such data file or directory")
    files = [p for p in files if not p.name.startswith((".", "_")) and p.suffix != ".done"]
    if not files:
        raise FeatureError(f"{s}: no data files")
    return files


def schema_columns(schema: Schema) -> tuple[str, ...]:
    """The columns of a headerless file: the label, then each slot's column, in schema order."""
    names = ([schema.label] if schema.label else []) + [s.column for s in schema.slots]
    return tuple(dict.fromkeys(names))


def _first_line(path: Path) -> bytes:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return f.readline(1 << 20).rstrip(b"\r\n")


def _is_number(field: str) -> bool:
    try:
        float(field)
    except ValueError:
        return False
    return True


def sniff(path: Path, schema: Schema, declared: str = "auto") -> FileFormat:
    """The format of one file: as declared, else from its suffix and first bytes."""
    kind, _, header = declared.partition(":")
    name = path.name[:-3] if path.suffix == ".gz" else path.name
    suffix = Path(name).suffix.lower()
    if kind == "auto":
        if suffix in PARQUET_SUFFIXES:
            kind = "parquet"
        elif suffix in TEXT_SUFFIXES:
            kind = "tsv" if TEXT_SUFFIXES[suffix] == "\t" else "csv"
        else:
            with open(path, "rb") as f:
                magic = f.read(4)
            kind = "parquet" if magic == b"PAR1" else "tsv" if b"\t" in _first_line(path) else "csv"
    if kind == "parquet":
        return FileFormat("parquet")
    sep = "\t" if kind == "tsv" else ","
    fields = _first_line(path).decode("utf-8", "replace").split(sep)
    if header:
        has_header = header == "header"
    else:
        known = set(schema_columns(schema))
        has_header = any(f in known for f in fields) and not any(_is_number(f) for f in fields)
    if has_header:
        return FileFormat("text", sep, True)
    columns = schema_columns(schema)
    if fields != [""] and len(fields) != len(columns):
        raise FeatureError(
            f"{path}: line 1 has {len(fields)} fields but the schema names {len(columns)} columns "
            f"(the label, then each slot's column); give the file a header line, or declare its format"
        )
    return FileFormat("text", sep, False, columns)


# --- Arrow -> numpy --------------------------------------------------------------------------------
@numba.njit(cache=True, nogil=True)
def _ascii_ucs4(offsets: NDArray[np.int32], data: NDArray[np.uint8], out: NDArray[np.uint32]) -> bool:
    """Widen ASCII strings (Arrow offsets + bytes) into the rows of a zeroed (n, width) uint32
    matrix, i.e. a numpy 'U' array; False at the first non-ASCII byte."""
    for i in range(out.shape[0]):
        a = offsets[i]
        for j in range(offsets[i + 1] - a):
            c = data[a + j]
            if c >= 128:
                return False
            out[i, j] = c
    return True


def unicode_column(arr: pa.Array) -> NDArray[np.str_]:
    """A pyarrow array as a numpy 'U' array, nulls as "" (one compiled pass for ASCII text)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not pa.types.is_string(arr.type):
        arr = arr.cast(pa.string())
    if arr.null_count:
        arr = pc.fill_null(arr, "")
    n = len(arr)
    offsets = np.frombuffer(arr.buffers()[1], np.int32, n + 1, arr.offset * 4)
    width = int((offsets[1:] - offsets[:-1]).max(initial=0))
    if width == 0:
        return np.full(n, "", dtype="U1")
    out = np.zeros((n, width), np.uint32)
    if _ascii_ucs4(offsets, np.frombuffer(arr.buffers()[2], np.uint8), out):
        return out.view(f"U{width}").reshape(n)
    text: NDArray[np.str_] = arr.to_numpy(zero_copy_only=False).astype(np.str_)
    return text


def float_column(arr: pa.Array, where: str = "") -> NDArray[np.float64]:
    """A pyarrow array as float64, NaN where missing or empty (strings parsed by Arrow; where
    Arrow refuses a value, numpy's parser decides, as ``transform`` would)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_string(arr.type):
        arr = pc.if_else(pc.equal(arr, ""), pa.scalar(None, arr.type), arr)
        try:
            arr = arr.cast(pa.float64())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return _numpy_floats(unicode_column(arr), where)
    elif not pa.types.is_floating(arr.type):
        arr = arr.cast(pa.float64())
    floats: NDArray[np.float64] = arr.to_numpy(zero_copy_only=False).astype(np.float64, copy=False)
    return floats


def _numpy_floats(u: NDArray[np.str_], where: str) -> NDArray[np.float64]:
    out = np.full(len(u), np.nan)
    present = u != ""
    try:
        out[present] = u[present].astype(np.float64)
    except ValueError:
        bad = next(i for i, v in enumerate(u) if v and not _is_number(v))  # error path only
        raise FeatureError(f"{where}: row {bad + 1} of the chunk, {u[bad][:40]!r} is not a number") from None
    return out


def to_table(batch: pa.RecordBatch, numeric: frozenset[str] = frozenset(), where: str = "") -> Table:
    """A pyarrow RecordBatch as a Table: strings, or float64 for the ``numeric`` columns."""
    cols: dict[str, NDArray[Any]] = {}
    for name, arr in zip(batch.schema.names, batch.columns, strict=True):
        if name in numeric:
            cols[name] = float_column(arr, f"{where}, column {name!r}")
        else:
            cols[name] = unicode_column(arr)
    return Table(cols, batch.num_rows)


# --- per-file record batches ---------------------------------------------------------------------
def text_batches(
    path: Path,
    delimiter: str,
    columns: tuple[str, ...] | None,
    block_size: int,
    include: list[str] | None = None,
) -> Iterator[pa.RecordBatch]:
    """Record batches (all strings) of a delimited text file; ``columns=None``: the first line is
    the header. A malformed line is a FeatureError naming the file and line."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    names = columns or tuple(_first_line(path).decode("utf-8", "replace").split(delimiter))
    bad: list[Any] = []  # pyarrow.csv.InvalidRow

    def invalid(row: Any) -> str:
        bad.append(row)
        return "error"

    options = dict(
        # serial: the stream is bounded anyway, and only then does Arrow know line numbers
        read_options=pacsv.ReadOptions(column_names=columns, block_size=block_size, use_threads=False),
        parse_options=pacsv.ParseOptions(delimiter=delimiter, quote_char=False, invalid_row_handler=invalid),
        convert_options=pacsv.ConvertOptions(
            column_types={c: pa.string() for c in names},
            include_columns=[c for c in include if c in names] if include is not None else None,
        ),
    )
    try:
        yield from pacsv.open_csv(str(path), **options)
    except pa.ArrowInvalid as e:
        if bad:
            row = bad[0]
            raise FeatureError(
                f"{path}: line {row.number}: expected {row.expected_columns} fields, got "
                f"{row.actual_columns}: {row.text[:80]!r}"
            ) from None
        raise FeatureError(f"{path}: {e}") from None


def parquet_batches(
    path: Path, batch_rows: int, include: list[str] | None = None
) -> Iterator[pa.RecordBatch]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        f = pq.ParquetFile(path)
        names = f.schema_arrow.names
        cols = [c for c in include if c in names] if include is not None else None
        yield from f.iter_batches(batch_size=batch_rows, columns=cols)
    except (pa.ArrowInvalid, OSError) as e:
        raise FeatureError(f"{path}: not a readable Parquet file ({e})") from None


# --- the stream ------------------------------------------------------------------------------------
def owned(start: int, stop: int, rank: int, world: int) -> Iterator[tuple[int, int]]:
    """The sub-ranges of global rows [start, stop) in this rank's pieces."""
    if world == 1:
        if stop > start:
            yield start, stop
        return
    piece = start // PIECE_ROWS
    while piece * PIECE_ROWS < stop:
        if piece % world == rank:
            yield max(start, piece * PIECE_ROWS), min(stop, (piece + 1) * PIECE_ROWS)
        piece += 1


def stream(
    source: str | Path,
    schema: Schema,
    options: ReadOptions = ReadOptions(),
    limit: int | None = None,
    part: tuple[int, int] = (0, 1),
    columns: list[str] | None = None,
) -> Iterator[Table]:
    """The rows of ``source`` (the first ``limit`` of them) as Tables of the columns the schema
    uses (or of ``columns`` only), in file order; with ``part=(rank, world)`` only that rank's
    pieces."""
    for _, _, table in located(source, schema, options, limit, part, columns):
        yield table


def located(
    source: str | Path,
    schema: Schema,
    options: ReadOptions = ReadOptions(),
    limit: int | None = None,
    part: tuple[int, int] = (0, 1),
    columns: list[str] | None = None,
) -> Iterator[tuple[Path, int, Table]]:
    """``stream``'s Tables, each with where it lies: its file and the file's row (0-based) its
    first row is."""
    rank, world = part
    include = list(schema_columns(schema)) if columns is None else list(columns)
    numeric = (
        frozenset(s.column for s in schema.dense) & set(include) if options.numeric_dense else frozenset()
    )
    seen = 0  # rows before this batch, over all files
    for path in expand(source):
        if path.stat().st_size == 0:
            continue
        fmt = sniff(path, schema, options.format)
        if fmt.kind == "parquet":
            batches = parquet_batches(path, options.batch_rows, include)
        else:
            names = None if fmt.header else fmt.columns
            batches = text_batches(path, fmt.delimiter, names, options.block_size, include)
        file_start = seen
        for batch in batches:
            n = batch.num_rows if limit is None else min(batch.num_rows, limit - seen)
            for a, b in owned(seen, seen + n, rank, world):
                where = f"{path}: rows {a - file_start + 1}..{b - file_start}"
                table = _fill_missing(to_table(batch.slice(a - seen, b - a), numeric, where), numeric)
                yield path, a - file_start, table
            seen += n
            if limit is not None and seen >= limit:
                return


def _fill_missing(table: Table, numeric: frozenset[str]) -> Table:
    """Absent numeric columns as all-NaN (absent string columns are blank to ``transform``)."""
    for name in numeric - table.columns.keys():
        table.columns[name] = np.full(table.num_rows, np.nan)
    return table


def concat(tables: list[Table]) -> Table:
    """One Table of several (columns concatenated; string widths unified by numpy)."""
    if not tables:
        return Table({}, 0)
    names = tables[0].columns.keys()
    return Table(
        {c: np.concatenate([t.columns[c] for t in tables]) for c in names}, sum(t.num_rows for t in tables)
    )


def read(
    source: str | Path, schema: Schema, options: ReadOptions = ReadOptions(), limit: int | None = None
) -> Table:
    """The whole source as one Table (for files that fit in memory)."""
    return concat(list(stream(source, schema, options, limit)))
