"""The ledger of a followed source: the rows consumed from each of its units (a file, a stream's
partition), whether the unit is done, and why it failed where it did.

Progress is kept apart until ``commit``, which the trainer calls after a delta's ``_SUCCESS``
(training/follow/trainer.py), so the ledger never claims rows that no published delta holds. The file
(JSON, replaced atomically) keeps the format of the first follow ledgers:
``{"files": {unit: {"rows", "done"[, "error"]}}}``.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from training.sources.types import TableChunk


class Ledger:
    """Rows consumed per unit; changes since the last ``commit`` are not on disk yet."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.units: dict[str, dict] = self._read()  # unit -> {"rows", "done"[, "error"]}
        self.progress: dict[str, dict] = {}  # entries changed since the last commit

    def reload(self) -> None:
        """Read the file again, dropping what is not committed (a standby taking over: the file is
        its predecessor's)."""
        self.units, self.progress = self._read(), {}

    def row(self, unit: str) -> int:
        """Rows of ``unit`` consumed: where reading it resumes."""
        return int(self._current(unit).get("rows", 0))

    def done(self, unit: str) -> bool:
        """``unit`` was read to its end, or failed."""
        return bool(self._current(unit).get("done"))

    def error(self, unit: str) -> str | None:
        return self._current(unit).get("error")

    def positions(self) -> dict[str, int]:
        """Every unit's rows consumed, the progress since the last commit included."""
        return {u: self.row(u) for u in sorted(set(self.units) | set(self.progress))}

    def resume(self, positions: dict[str, int]) -> None:
        """Take these units' rows as consumed and committed (what a published delta recorded:
        it wins over a ledger file that a crash left behind it)."""
        for unit, row in positions.items():
            self.units[unit] = dict(self.units.get(unit, {"done": False})) | {"rows": int(row)}
            self.progress.pop(unit, None)

    def advance(self, unit: str, rows: int) -> None:
        """``rows`` more rows of ``unit`` consumed."""
        self._entry(unit)["rows"] += rows

    def finish(self, chunk: TableChunk) -> None:
        """Mark the unit of a ``last`` chunk done once its rows are consumed."""
        if chunk.last:
            self._entry(chunk.start.unit)["done"] = True

    def fail(self, unit: str, error: str) -> None:
        """Skip the rest of ``unit``: it cannot be read (or trained on) from where it stands."""
        self._entry(unit).update(done=True, error=error)

    def take(self) -> dict[str, dict]:
        """The progress so far, for ``commit`` once the delta that holds it is published (a delta
        written on its own thread: training goes on meanwhile)."""
        return {unit: dict(entry) for unit, entry in self.progress.items()}

    def commit(self, taken: dict[str, dict] | None = None) -> None:
        """Move the progress (or what ``take`` returned: the progress since stays apart) into the
        ledger file (atomically): call after a delta's _SUCCESS."""
        progress = self.progress if taken is None else taken
        if not progress:
            return
        self.units.update(progress)
        self.progress = {} if taken is None else {u: e for u, e in self.progress.items() if e != taken.get(u)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps({"files": self.units}, indent=1, sort_keys=True))
        os.replace(tmp, self.path)

    def _current(self, unit: str) -> dict:
        return self.progress.get(unit) or self.units.get(unit) or {}

    def _entry(self, unit: str) -> dict:
        if unit not in self.progress:
            self.progress[unit] = dict(self.units.get(unit, {"rows": 0, "done": False}))
        return self.progress[unit]

    def _read(self) -> dict[str, dict]:
        try:
            return dict(json.loads(self.path.read_text())["files"])
        except FileNotFoundError:
            return {}
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{self.path}: unreadable follow ledger ({e}); move it away") from e


def ledger_path(path: Path, rank: int = 0, world: int = 1) -> Path:
    """The ledger of ``rank``: ``path`` itself (``FollowConfig.ledger``), or with ranks one per rank
    (``-rank<r>`` before the suffix)."""
    return path.with_name(f"{path.stem}-rank{rank}{path.suffix}") if world > 1 else path
