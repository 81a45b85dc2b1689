"""The directory ``recserve train --follow`` watches: which of its files are complete data, and
the ledger of the rows trained from each.

Which files count: ``.tsv``/``.txt`` (Criteo, headerless) or ``.csv`` (with a header) whose name
does not start with '.' (so not ``x.csv.tmp`` nor ``.x.csv``), once complete: a ``<name>.done``
marker exists, or its size and mtime did not change between two polls. Producers should write
under a hidden or ``.tmp`` name and rename, or write the marker after the file.

The ledger (``<watch>/.recserve-follow-<model>.json`` by default) records the rows trained per
file; progress is kept apart until ``commit``, which the trainer calls after a delta's
``_SUCCESS`` (training/follow.py).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

SUFFIXES = (".tsv", ".txt", ".csv")  # so x.csv.tmp, x.csv.part, x.csv.done are not data
DONE = ".done"


class WatchDir:
    """New complete data files of a directory, and the ledger of the rows trained from each."""

    def __init__(self, directory: str | os.PathLike, ledger: str | os.PathLike):
        self.dir = Path(directory)
        self.ledger_path = Path(ledger)
        self.ledger: dict[str, dict] = self._read_ledger()  # name -> {"rows", "done"[, "error"]}
        self.progress: dict[str, dict] = {}  # entries changed since the last commit
        self._seen: dict[str, tuple[int, int]] = {}  # name -> (size, mtime_ns) at the last poll
        self.pending = 0  # candidates seen at the last poll that are not complete yet

    def ready(self) -> list[Path]:
        """Complete files not trained to the end yet, oldest first. Call once per poll: a file
        without a marker becomes complete when two polls in a row see the same size and mtime."""
        out, seen, self.pending = [], {}, 0
        try:
            entries = list(os.scandir(self.dir))
        except FileNotFoundError:
            entries = []
        for e in entries:
            name = e.name
            if not _is_data_name(name) or self._done(name) or not e.is_file():
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

    def entry(self, name: str) -> dict:
        """The mutable progress entry of a file: ``rows`` trained so far, ``done``."""
        if name not in self.progress:
            self.progress[name] = dict(self.ledger.get(name, {"rows": 0, "done": False}))
        return self.progress[name]

    def commit(self) -> None:
        """Move the progress into the ledger file (atomically): call after a delta's _SUCCESS."""
        if not self.progress:
            return
        self.ledger.update(self.progress)
        self.progress = {}
        self.ledger_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.ledger_path.with_name(f".{self.ledger_path.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps({"files": self.ledger}, indent=1, sort_keys=True))
        os.replace(tmp, self.ledger_path)

    def _done(self, name: str) -> bool:
        return bool((self.progress.get(name) or self.ledger.get(name) or {}).get("done"))

    def _read_ledger(self) -> dict[str, dict]:
        try:
            return dict(json.loads(self.ledger_path.read_text())["files"])
        except FileNotFoundError:
            return {}
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.ledger_path}: unreadable follow ledger ({e}); move it away") from e


def _is_data_name(name: str) -> bool:
    return not name.startswith(".") and name.endswith(SUFFIXES)
