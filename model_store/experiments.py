"""A model's experiment, ``<root>/<model>/EXPERIMENT``: the typed record ``Experiment`` with its one
writer and one reader, its history (``<model>/EXPERIMENTS.log``), and the one assignment of units
to arms.

An experiment splits a model's traffic between versions, its arms: ``control`` (the version CURRENT
named when it started) and candidates, each serving a share of the units; a shadow arm (share 0)
serves none and is scored off the response path. Serving processes follow the record as they
follow CURRENT; ``read_experiment`` raises ``ExperimentError`` for a record it cannot take
(malformed JSON, another format, shares that do not add up, an arm the store cannot serve beside
control), and the caller keeps the last good one. ``write_experiment`` runs the same checks before
it writes, atomically, so a bad record never replaces a good one.

Assignment (``assign``): a pure function of unit key and salt, the same in every process and host::

    u = (XXH64(unit key, seed = first 8 bytes of sha256(salt), little-endian) >> 11) / 2**53
    a candidate serves the units with offset <= u < offset + share; control every other unit

The offsets are laid out once, at ``start``: aborting an arm hands its units to control and moves
no unit of another arm.

Every change (``start``, ``promote``, ``abort``, ``stop``) is one read-modify-write under the
model's experiment lock (the operator and the rule may act at once): the record, then one JSON line
appended to ``EXPERIMENTS.log``. Not HISTORY: its lines are the versions rollback walks back
(``promote`` publishes through ``releases.publish``, which writes HISTORY as for any publish).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from features.hashing import xxh64_strings
from model_store import layout as ms
from model_store.errors import ModelStoreError, RecordError
from model_store.records import decode
from model_store.releases import Root, publish, validate

FORMAT = "recserve-experiment/1"
NAME = "EXPERIMENT"
LOG = "EXPERIMENTS.log"
LOCK = ".EXPERIMENT.lock"
CONTROL = "control"
RUNNING, STOPPED, PROMOTED, ABORTED = "running", "stopped", "promoted", "aborted"
STATES = (RUNNING, STOPPED, PROMOTED, ABORTED)
DECISIONS = (PROMOTED, ABORTED)
DECIDERS = ("rule", "operator")
TOLERANCE = 1e-9
"""How far the shares of the arms that serve units may sum away from 1."""


class ExperimentError(ModelStoreError):
    """An experiment record that cannot be read or written, or a change that cannot be made (none
    running, an unknown arm, shares over 100%); the message names the field and the value."""


@dataclass(frozen=True)
class Arm:
    """One version of an experiment and the units it serves."""

    name: str
    version: str
    share: float
    """The fraction of units it serves: control's is what the candidates leave; 0 for a shadow."""
    shadow: bool = False
    """Scored off the response path beside the arm that serves the request; serves no unit."""
    offset: float = 0.0
    """Where a candidate's slice of [0, 1) begins (control serves what no candidate does)."""


@dataclass(frozen=True)
class Decision:
    """An arm promoted or aborted, by the rule or an operator, and why."""

    arm: str
    version: str
    decision: str
    """promoted | aborted"""
    at: float
    by: str
    """rule | operator"""
    evidence: dict[str, Any] = field(default_factory=dict)
    """What the decision rests on (the rule's statistics; an operator's note)."""


@dataclass(frozen=True)
class Experiment:
    """``<model>/EXPERIMENT``: the arms of a model's experiment and what became of them."""

    name: str
    salt: str
    """Hashed with each unit key (``assign``); a new salt reshuffles every unit."""
    arms: list[Arm]
    unit_key: str = ""
    """The request field that names a unit (a user id); '': the request id."""
    state: str = RUNNING
    """running | stopped | promoted | aborted"""
    started: float = 0.0
    ended: float | None = None
    decisions: list[Decision] = field(default_factory=list)
    format: str = FORMAT

    @property
    def running(self) -> bool:
        return self.state == RUNNING

    def arm(self, name: str) -> Arm:
        for a in self.arms:
            if a.name == name:
                return a
        raise ExperimentError(f"experiment {self.name!r} has no arm {name!r} (arms: {self.names()})")

    def names(self) -> list[str]:
        return [a.name for a in self.arms]


@dataclass(frozen=True)
class LogEntry:
    """One line of ``EXPERIMENTS.log``: a change (started | promoted | aborted | stopped), who made
    it (rule | operator) and the record it left."""

    event: str
    at: float
    by: str
    record: Experiment


# ---- the record: check, write, read --------------------------------------------------------------
def check(exp: Experiment, where: str) -> Experiment:
    """``exp`` if its fields hold together (the store aside: ``check_versions``), else
    ExperimentError naming the field and the value."""

    def refuse(what: str) -> ExperimentError:
        return ExperimentError(f"{where}: experiment {exp.name!r}: {what}")

    if not exp.name or not exp.salt:
        raise refuse(f"name {exp.name!r} and salt {exp.salt!r} must not be empty")
    if exp.state not in STATES:
        raise refuse(f"state {exp.state!r} is none of {STATES}")
    names = exp.names()
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise refuse(f"arms named twice: {twice}")
    if CONTROL not in names or exp.arm(CONTROL).shadow:
        raise refuse(f"no {CONTROL!r} arm serving units (arms: {names})")
    for a in exp.arms:
        if not 0.0 <= a.share <= 1.0:  # NaN fails too
            raise refuse(f"arm {a.name!r} share {a.share!r} is outside [0, 1]")
        if a.shadow and a.share > 0:
            raise refuse(f"shadow arm {a.name!r} has share {a.share!r}: a shadow serves no unit (share 0)")
    total = sum(a.share for a in exp.arms if not a.shadow)
    if abs(total - 1.0) > TOLERANCE:
        raise refuse(f"the shares of the arms that serve units add up to {total!r}, not 1")
    end = 0.0
    for a in sorted(_candidates(exp), key=lambda a: a.offset):
        if a.offset < end - TOLERANCE or a.offset + a.share > 1.0 + TOLERANCE:
            raise refuse(f"arm {a.name!r} offset {a.offset!r}: its slice overlaps another or leaves [0, 1)")
        end = a.offset + a.share
    for d in exp.decisions:
        if d.decision not in DECISIONS or d.by not in DECIDERS:
            raise refuse(f"decision {d.decision!r} by {d.by!r}: decisions are {DECISIONS} by {DECIDERS}")
    return exp


def check_versions(root: Root, model: str, exp: Experiment, where: str, verify: bool) -> None:
    """Of a running experiment: every arm's version passes the gate (``releases.validate``) --
    control's on its own, every other arm's beside control's (same schema and shapes); else
    ExperimentError naming the arm and its version. ``verify``: check every file's checksum."""
    if not exp.running:
        return  # an ended experiment's versions may since have gone (retention)
    control = exp.arm(CONTROL)
    served = None
    for a in [control, *(a for a in exp.arms if a is not control)]:  # control first: the others beside it
        try:
            manifest = validate(root, model, a.version, served, verify=verify)
        except ModelStoreError as e:
            beside = "" if a is control else f" beside control (version {control.version})"
            raise ExperimentError(
                f"{where}: experiment {exp.name!r}: arm {a.name!r} version {a.version!r} cannot be served{beside}: {e}"
            ) from e
        served = served or manifest


def write_experiment(root: Root, model: str, exp: Experiment, verify: bool = True) -> Experiment:
    """Write ``<model>/EXPERIMENT`` atomically, once it passed ``check`` and ``check_versions``
    (the one writer: a record that fails them never replaces the one on disk)."""
    path = ms.model_dir(root, model) / NAME
    check(exp, str(path))
    check_versions(root, model, exp, str(path), verify)
    ms.write_atomic(path, json.dumps(asdict(exp), indent=1, sort_keys=True).encode())
    return exp


def read_experiment(root: Root, model: str) -> Experiment | None:
    """The model's experiment (None: it never had one), or ExperimentError naming what is wrong
    with the record on disk -- a serving process keeps the last good record it read."""
    path = ms.model_dir(root, model) / NAME
    try:
        raw = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except ValueError as e:  # not UTF-8 or not JSON
        raise ExperimentError(f"{path}: not an experiment record: {e}") from None
    try:
        exp = _typed(decode(Experiment, raw, "experiment record", str(path)), str(path))
    except RecordError as e:
        raise ExperimentError(str(e)) from e
    check(exp, str(path))
    check_versions(root, model, exp, str(path), verify=False)
    return exp


def _typed(exp: Experiment, where: str) -> Experiment:
    """``exp`` with its arms and decisions decoded (``decode`` takes a list's items as they are)."""
    arms = [decode(Arm, a, "experiment arm", where) for a in exp.arms]
    return replace(
        exp, arms=arms, decisions=[decode(Decision, d, "experiment decision", where) for d in exp.decisions]
    )


# ---- assignment ----------------------------------------------------------------------------------
def salt_seed(salt: str) -> int:
    """The 64-bit XXH64 seed of a salt: the first 8 bytes of its sha256, little-endian."""
    return int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "little")


def unit_positions(unit_keys: Sequence[str] | NDArray[np.str_], salt: str) -> NDArray[np.float64]:
    """Each unit's place in [0, 1): the top 53 bits of XXH64(key, salt_seed(salt)), scaled."""
    h = xxh64_strings(np.asarray(unit_keys, dtype=np.str_), salt_seed(salt))
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


def assign(unit_keys: Sequence[str] | NDArray[np.str_], exp: Experiment) -> NDArray[np.int64]:
    """The index in ``exp.arms`` of the arm serving each unit (never a shadow), in one pass; a
    running experiment only (an ended one serves CURRENT: ExperimentError)."""
    if not exp.running:
        raise ExperimentError(f"experiment {exp.name!r} is {exp.state}: it assigns no unit (serve CURRENT)")
    u = unit_positions(unit_keys, exp.salt)
    index = {a.name: i for i, a in enumerate(exp.arms)}
    slices = sorted(_candidates(exp), key=lambda a: a.offset)
    edges = np.array([x for a in slices for x in (a.offset, a.offset + a.share)], np.float64)
    owner = np.full(2 * len(slices) + 1, index[CONTROL], np.int64)  # between slices: control
    owner[1::2] = [index[a.name] for a in slices]
    return owner[np.searchsorted(edges, u, side="right")]


def _candidates(exp: Experiment) -> list[Arm]:
    """The arms that serve units besides control."""
    return [a for a in exp.arms if a.name != CONTROL and not a.shadow]


# ---- changes: start, promote, abort, stop --------------------------------------------------------
def start(
    root: Root, model: str, name: str, candidates: Sequence[tuple[str, float]], shadows: Sequence[str] = (),
    unit_key: str = "", salt: str = "", by: str = "operator",
) -> Experiment:  # fmt: skip
    """Start experiment ``name``: control is CURRENT's version with the share the ``candidates``
    ((version, share), arms A, B, ...) leave, ``shadows`` (versions) follow them (share 0). Refused
    (ExperimentError): one already running, nothing published, shares <= 0 or over 100% together,
    a version the gate refuses beside CURRENT. ``salt`` '': derived from the name and start time."""
    with _locked(root, model):
        old = read_experiment(root, model)
        if old is not None and old.running:
            raise ExperimentError(f"experiment {old.name!r} is running for {model}: stop it first")
        current = ms.current(root, model)
        if current is None:
            raise ExperimentError(f"{model}: nothing is published: an experiment's control is CURRENT")
        if not candidates and not shadows:
            raise ExperimentError(f"experiment {name!r}: no candidate or shadow arm beside control")
        total = sum(share for _, share in candidates)
        bad = [share for _, share in candidates if not 0.0 < share <= 1.0]
        if bad or total > 1.0 + TOLERANCE:
            what = f"share {bad[0]!r} is not in (0, 1]" if bad else f"shares add up to {total:.1%}, over 100%"
            raise ExperimentError(f"experiment {name!r}: candidate {what} (a shadow scores with no share)")
        arms, offset = [], 0.0
        for i, (version, share) in enumerate(candidates):
            arms.append(Arm(chr(ord("A") + i), str(version), float(share), offset=offset))
            offset += share
        letters = (chr(ord("A") + len(arms) + i) for i in range(len(shadows)))
        arms += [Arm(n, str(v), 0.0, shadow=True) for n, v in zip(letters, shadows, strict=True)]
        now = time.time()
        exp = Experiment(name, salt or f"{name}/{now:.6f}", [Arm(CONTROL, current, max(0.0, 1.0 - total)), *arms],
                         unit_key, RUNNING, now)  # fmt: skip
        write_experiment(root, model, exp, verify=True)
        _log(root, model, exp, "started", by)
        return exp


def promote(root: Root, model: str, arm: str, by: str = "operator", evidence: dict[str, Any] | None = None) -> Experiment:  # fmt: skip
    """Publish ``arm``'s version through the gate (``releases.publish``), record the decision and
    end the experiment (promoted). The gate's refusal is raised and nothing is recorded."""
    with _locked(root, model):
        exp = _running(root, model, f"promote {arm!r}")
        chosen = _candidate(exp, arm, "promote")
        publish(root, model, chosen.version)
        decision = Decision(arm, chosen.version, PROMOTED, time.time(), by, dict(evidence or {}))
        done = replace(exp, state=PROMOTED, ended=decision.at, decisions=[*exp.decisions, decision])
        return _commit(root, model, done, PROMOTED, by)


def abort(root: Root, model: str, arm: str, by: str = "operator", evidence: dict[str, Any] | None = None) -> Experiment:  # fmt: skip
    """Remove ``arm``: its units go back to control (no other arm's unit moves); record the
    decision. When only control is left the experiment ends (aborted)."""
    with _locked(root, model):
        exp = _running(root, model, f"abort {arm!r}")
        gone, control = _candidate(exp, arm, "abort"), exp.arm(CONTROL)
        decision = Decision(arm, gone.version, ABORTED, time.time(), by, dict(evidence or {}))
        arms = [replace(a, share=a.share + gone.share) if a is control else a for a in exp.arms if a is not gone]  # fmt: skip
        over = len(arms) == 1
        done = replace(exp, arms=arms, decisions=[*exp.decisions, decision],
                       state=ABORTED if over else RUNNING, ended=decision.at if over else None)  # fmt: skip
        return _commit(root, model, done, ABORTED, by)


def stop(root: Root, model: str, by: str = "operator") -> Experiment:
    """End the running experiment with no decision: serving returns to CURRENT (control's)."""
    with _locked(root, model):
        exp = _running(root, model, "stop")
        return _commit(root, model, replace(exp, state=STOPPED, ended=time.time()), STOPPED, by)


def _running(root: Root, model: str, verb: str) -> Experiment:
    """The running experiment, read for a change (ExperimentError: none, or it does not read)."""
    try:
        exp = read_experiment(root, model)
    except ExperimentError as e:
        raise ExperimentError(
            f"{e} -- cannot {verb} until it reads (remove {ms.model_dir(root, model) / NAME} to start "
            f"afresh; {LOG} keeps what happened)"
        ) from e
    if exp is None or not exp.running:
        was = f" ({exp.name!r} is {exp.state})" if exp else ""
        raise ExperimentError(f"{model}: no experiment is running{was}: nothing to {verb}")
    return exp


def _candidate(exp: Experiment, arm: str, verb: str) -> Arm:
    if arm == CONTROL:
        raise ExperimentError(
            f"cannot {verb} {CONTROL!r}: it is CURRENT already (`stop` ends the experiment)"
        )
    return exp.arm(arm)


def _commit(root: Root, model: str, exp: Experiment, event: str, by: str) -> Experiment:
    """Write the changed record (its versions passed the gate when it started), then its log line."""
    write_experiment(root, model, exp, verify=False)
    _log(root, model, exp, event, by)
    return exp


@contextlib.contextmanager
def _locked(root: Root, model: str) -> Iterator[None]:
    """The model's experiment lock (flock): one read-modify-write of the record at a time."""
    path = ms.model_dir(root, model) / LOCK
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


# ---- history -------------------------------------------------------------------------------------
def _log(root: Root, model: str, exp: Experiment, event: str, by: str) -> None:
    """Append one line to ``EXPERIMENTS.log`` (O_APPEND, one write, fsync): the one writer."""
    line = (json.dumps(asdict(LogEntry(event, time.time(), by, exp)), sort_keys=True) + "\n").encode()
    fd = os.open(ms.model_dir(root, model) / LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_log(root: Root, model: str) -> list[LogEntry]:
    """Every change of the model's experiments, oldest first (the one reader of ``EXPERIMENTS.log``)."""
    path = ms.model_dir(root, model) / LOG
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for n, line in enumerate(lines, 1):
        where = f"{path}:{n}"
        try:
            entry = decode(LogEntry, json.loads(line), "experiment log entry", where)
            out.append(replace(entry, record=_typed(entry.record, where)))
        except (ValueError, RecordError) as e:
            raise ExperimentError(f"{where}: unreadable line: {e}") from None
    return out
