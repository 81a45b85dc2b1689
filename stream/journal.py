"""The requests of a partition past their first horizon, durable beside their spilled impressions
(``stream.spill``): what lets ``recserve join --attribution-s`` commit its input offsets past a
request as soon as its first labels are delivered, instead of holding them for the whole
attribution window (which a restart would then re-read, and a broker may no longer hold).

A line per change, appended (``os.write``, so a process killed after it returns has it; a torn last
line, from a kill mid-write, is ignored):

- ``{"r": rid, "o": offset, "t": ts, "n": items, "w": [bucket, at, size], "c": [items clicked], "q": quarantine}``
  once the request's first labels (and the corrections emitted with them) are acknowledged;
- ``{"r": rid, "c": [items]}`` once corrections of those items are acknowledged.

The joiner writes a line before it commits the offsets that pass the records it settles, so every
committed offset is covered by the journal. ``replay`` folds the lines into the requests they
describe; ``compact`` rewrites the file with only those still live (atomically: a new file renamed
over the old).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import orjson

from stream.join_state import _Request


@dataclass
class Settled:
    """A request past its first horizon whose samples so far are all acknowledged."""

    offset: int  # its impression's
    ts: float
    items: int
    where: tuple[int, int, int]  # its impression in the spill
    clicked: set[int] = field(default_factory=set)
    quarantine: bool = False

    @classmethod
    def of(cls, req: _Request) -> Settled:
        assert req.labelled is not None and req.where is not None
        # a correction not yet acknowledged is not in the journal: a restart re-reads its event
        clicked = set(np.flatnonzero(req.labelled).tolist()) - set(req.unjournaled)
        return cls(req.offset, req.ts, len(req.labelled), req.where, clicked, req.quarantine)

    def request(self, label_after_s: float) -> _Request:
        """The join's state of it (closed, settled)."""
        labelled = np.zeros(self.items, bool)
        labelled[sorted(self.clicked)] = True
        return _Request(deadline=self.ts + label_after_s, ts=self.ts, offset=self.offset, where=self.where,
                        labelled=labelled, closed=True, settled=True, quarantine=self.quarantine)  # fmt: skip


class Journal:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.bytes = os.fstat(self._fd).st_size

    def settled(self, rid: str, s: Settled) -> None:
        self._write(_line(rid, s))

    def clicked(self, rid: str, items: list[int]) -> None:
        self._write(orjson.dumps({"r": rid, "c": items}) + b"\n")

    def _write(self, data: bytes) -> None:
        os.write(self._fd, data)
        self.bytes += len(data)

    def replay(self) -> dict[str, Settled]:
        """The requests the lines describe, in the order they were settled."""
        out: dict[str, Settled] = {}
        for line in self.path.read_bytes().split(b"\n"):
            try:
                d = orjson.loads(line)
            except orjson.JSONDecodeError:  # a torn last line (or the empty one after the last)
                continue
            if "o" in d:
                b, at, size = d["w"]
                out[d["r"]] = Settled(d["o"], d["t"], d["n"], (b, at, size), set(d["c"]), d["q"])
            elif d["r"] in out:
                out[d["r"]].clicked.update(d["c"])
        return out

    def compact(self, requests: dict[str, _Request]) -> None:
        """Rewrite the file with the settled ``requests`` only."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(b"".join(_line(rid, Settled.of(r)) for rid, r in requests.items() if r.settled))
        os.replace(tmp, self.path)
        os.close(self._fd)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.bytes = os.fstat(self._fd).st_size

    def clear(self) -> None:
        self.compact({})

    def close(self) -> None:
        os.close(self._fd)


def _line(rid: str, s: Settled) -> bytes:
    return orjson.dumps({"r": rid, "o": s.offset, "t": s.ts, "n": s.items, "w": list(s.where),
                         "c": sorted(s.clicked), "q": s.quarantine}) + b"\n"  # fmt: skip
