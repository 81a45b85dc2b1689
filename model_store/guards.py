"""The guards' history in the model store: ``<model>/GUARDS.log``, one JSON object a line, each a
trip, rewind or recovery of a guard of the learning loop (the joiner's input guard, the streaming
trainer's output guard), appended by its one writer ``record`` and read by ``read_guards``
(``recserve versions`` shows the last ones)::

    {"format": "recserve-guard/1", "at": 1767225600.5, "guard": "output", "event": "trip",
     "reason": "served AUC 0.27 ...", "version": "3", "delta": 41, "to": 0}

``event`` is ``trip``, ``rewind`` (the output guard's: ``to`` the delta the rows are back at,
``delta`` the rewind's own) or ``clear``. A line that cannot be read is skipped by name in the
reader's result, never fatal: the log is a record for people, the metrics are the live state.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from model_store.errors import RecordError
from model_store.records import decode

log = logging.getLogger("recserve.guards")
NAME = "GUARDS.log"
FORMAT = "recserve-guard/1"
GUARDS = ("input", "output")
EVENTS = ("trip", "rewind", "clear")


@dataclass(frozen=True)
class GuardEvent:
    guard: str
    event: str
    reason: str = ""
    version: str = ""
    delta: int = -1
    to: int = -1
    at: float = 0.0
    format: str = FORMAT


def record(model_dir: str | os.PathLike[str], event: GuardEvent) -> GuardEvent:
    """Append ``event`` (stamped now) to the model's guard log; the event written."""
    if event.guard not in GUARDS or event.event not in EVENTS:
        raise ValueError(
            f"a guard event is one of {EVENTS} of one of {GUARDS}, got {event.event!r} of {event.guard!r}"
        )
    event = GuardEvent(**{**asdict(event), "at": time.time(), "format": FORMAT})
    line = json.dumps(asdict(event), sort_keys=True) + "\n"
    with open(Path(model_dir) / NAME, "a", encoding="utf-8") as f:  # one write: lines never interleave
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
    return event


def record_or_log(model_dir: str | os.PathLike[str], event: GuardEvent) -> None:
    """``record``, logging (not raising) a write that fails: a guard acts whatever the store's
    history can take; its metrics and its log keep the event."""
    try:
        record(model_dir, event)
    except OSError as e:
        log.error("cannot record the %s guard's %s in %s: %s", event.guard, event.event, model_dir, e)


def read_guards(model_dir: str | os.PathLike[str], last: int = 0) -> tuple[list[GuardEvent], list[str]]:
    """The model's guard events, oldest first (``last``: only the newest ``last``), and why each
    unreadable line was skipped."""
    path = Path(model_dir) / NAME
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return [], []
    events, bad = [], []
    for n, line in enumerate(lines, 1):
        try:
            events.append(decode(GuardEvent, json.loads(line), "guard event", f"{path}:{n}", (FORMAT,)))
        except (ValueError, RecordError) as e:
            bad.append(f"{path}:{n}: {e}")
    return events[-last:] if last else events, bad
