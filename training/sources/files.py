"""Files: a data file, a directory of them or a glob, read by ``features.stream`` (TSV/CSV with or
without a header, Parquet, gzip), bounded: every epoch reads it again. A chunk's position is its
file and the file's row."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from features import stream
from training.sources.ledger import Ledger
from training.sources.registry import SourceKind, register
from training.sources.types import Part, Position, Reading, TableChunk


@dataclass(frozen=True)
class Files:
    where: str
    reading: Reading
    bounded = True

    def chunks(self) -> Iterator[TableChunk]:
        r = self.reading
        for path, row, table in stream.located(self.where, r.schema, r.options, r.limit, r.part, r.columns):
            yield TableChunk(table, Position(str(path), row))

    def behind(self) -> int | None:
        return None  # a bounded source; its rows are read as they are

    def skipped(self) -> int:
        return 0

    def list_parts(self) -> list[Part]:
        return []  # ranks share its rows (``Reading.part``), not parts

    def __str__(self) -> str:
        return self.where


def _open(where: str, reading: Reading, ledger: Ledger | None) -> Files:
    return Files(where, reading)


KIND = register(SourceKind("files", _open))
