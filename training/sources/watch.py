"""A watched directory (``recserve train --follow --watch DIR``), unbounded: its complete data
files, oldest first, each read once from the row the ledger says, and a ``TICK`` after every look.

Which files count: ``.tsv``/``.txt`` (Criteo, headerless) or ``.csv`` (with a header) whose name
does not start with '.' (so not ``x.csv.tmp`` nor ``.x.csv``), once complete: a ``<name>.done``
marker exists, or its size and mtime did not change between two looks. Producers should write
under a hidden or ``.tmp`` name and rename, or write the marker after the file. A chunk's unit is
the file's name; a file that cannot be read is failed in the ledger (from where it cannot) and
the next one is read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from features import stream
from features.transform import FeatureError, Table
from training.sources.ledger import Ledger
from training.sources.registry import SourceKind, register
from training.sources.types import TICK, Part, Position, Reading, TableChunk

log = logging.getLogger("recserve.train.follow")

SUFFIXES = (".tsv", ".txt", ".csv")  # so x.csv.tmp, x.csv.part, x.csv.done are not data
DONE = ".done"


class WatchDir:
    """New complete data files of a directory (those the ledger does not call done)."""

    def __init__(self, directory: str | os.PathLike, ledger: Ledger):
        self.dir = Path(directory)
        self.ledger = ledger
        self._seen: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) at the last look
        self.pending = 0  # candidates seen at the last look that are not complete yet

    def ready(self) -> list[Path]:
        """Complete files not read to the end yet, oldest first. Call once per look: a file
        without a marker becomes complete when two looks in a row see the same size and mtime."""
        out, seen, self.pending = [], {}, 0
        try:
            entries = list(os.scandir(self.dir))
        except FileNotFoundError:
            entries = []
        for e in entries:
            name = e.name
            if not _is_data_name(name) or self.ledger.done(name) or not e.is_file():
                continue
            st = e.stat()
            seen[name] = (st.st_size, st.st_mtime_ns)
            marked = (self.dir / (name + DONE)).exists()
            if marked or (st.st_size > 0 and self._seen.get(name) == seen[name]):
                out.append((st.st_mtime_ns, name))
            else:
                self.pending += 1
        self._seen = seen
        return [self.dir / name for _, name in sorted(out)]


@dataclass
class Watched:
    files: WatchDir
    reading: Reading
    bounded = False

    def chunks(self) -> Iterator[TableChunk]:
        r = self.reading
        ready = self.files.ready()
        if r.once and self.files.pending:  # files without a marker need a second look to count
            r.wait(r.poll_s)
            ready = self.files.ready()
        while True:
            yield TICK
            for path in ready:
                yield from self._file(path)
            if r.once:
                return
            r.wait(r.poll_s)
            ready = self.files.ready()

    def _file(self, path: Path) -> Iterator[TableChunk]:
        ledger, name = self.files.ledger, path.name
        start = row = ledger.row(name)
        try:
            for table in _rows_after(stream.stream(path, self.reading.schema, self.reading.options), start):
                if ledger.done(name):  # the consumer failed it
                    return
                yield TableChunk(table, Position(name, row))
                row += table.num_rows
        except (FeatureError, OSError, UnicodeDecodeError, ValueError) as e:
            log.error("%s: skipping the rest of it: cannot read it: %s", path, e)
            ledger.fail(name, f"cannot read it: {e}")
            return
        yield TableChunk(Table({}, 0), Position(name, row), last=True)

    def behind(self) -> int | None:
        return None  # files may arrive at any time

    def skipped(self) -> int:
        return 0

    def list_parts(self) -> list[Part]:
        return []  # one process reads a watched directory

    def __str__(self) -> str:
        return f"watch://{self.files.dir}"


def _rows_after(tables: Iterable[Table], skip: int) -> Iterator[Table]:
    """The rows of ``tables`` after the first ``skip`` (those the ledger says are consumed)."""
    for t in tables:
        if skip >= t.num_rows:
            skip -= t.num_rows
            continue
        yield Table({k: v[skip:] for k, v in t.columns.items()}, t.num_rows - skip) if skip else t
        skip = 0


def _is_data_name(name: str) -> bool:
    return not name.startswith(".") and name.endswith(SUFFIXES)


def _open(where: str, reading: Reading, ledger: Ledger | None) -> Watched:
    if ledger is None:
        raise ValueError(f"{where}: a watched directory is read with a ledger of what was consumed")
    return Watched(WatchDir(where, ledger), reading)


KIND = register(SourceKind("watch", _open))
