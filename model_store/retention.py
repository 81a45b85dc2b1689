"""Retention: keep a model's store bounded however long a streaming trainer writes full versions.

``retain(root, model, keep)`` deletes every complete version but the newest ``keep``, and never:

- the version CURRENT names (served, or being switched to),
- the one published before it (``HISTORY``): a serving process may still read it while it drains
  a switch, and it is what ``recserve rollback`` returns to. Nothing tells the store which version
  each serving process reads, so these two are what it keeps for them;
- a pinned version (``<model>/PINNED``, one version a line: ``recserve versions --pin V``), e.g.
  the version a ``recserve ps --pin V`` serves.

A version's deltas live in its directory and go with it. Incomplete versions older than the
newest complete one (abandoned writers) and their stale staging directories go too.
"""

from __future__ import annotations

import shutil

from model_store import layout as ms
from model_store.errors import IncompleteVersion, VersionNotFound
from model_store.releases import Root, history

PINNED = "PINNED"


def pins(root: Root, model: str) -> list[str]:
    """The pinned versions, in the order they were pinned."""
    try:
        return [v for v in (ms.model_dir(root, model) / PINNED).read_text().split() if v]
    except FileNotFoundError:
        return []


def pin(root: Root, model: str, version: str) -> list[str]:
    """Pin a complete version: retention keeps it until it is unpinned. Returns the pins."""
    vdir = ms.version_dir(root, model, version)
    if not vdir.is_dir():
        raise VersionNotFound(f"{model} version {version} does not exist in {root}")
    if not (vdir / ms.SUCCESS).is_file():
        raise IncompleteVersion(f"{vdir}: no {ms.SUCCESS}: only a complete version can be pinned")
    return _write(root, model, [*(v for v in pins(root, model) if v != version), version])


def unpin(root: Root, model: str, version: str) -> list[str]:
    """Remove a pin (a version that is not pinned is an error: a typo must not pass silently)."""
    now = pins(root, model)
    if version not in now:
        raise VersionNotFound(f"{model} version {version} is not pinned (pinned: {', '.join(now) or 'none'})")
    return _write(root, model, [v for v in now if v != version])


def _write(root: Root, model: str, versions: list[str]) -> list[str]:
    ms.write_atomic(ms.model_dir(root, model) / PINNED, "".join(f"{v}\n" for v in versions).encode())
    return versions


def protected(root: Root, model: str) -> set[str]:
    """What retention never deletes: CURRENT, the version published before it, the pins."""
    cur = ms.current(root, model)
    return {v for v in (cur, *history(root, model)[-2:], *pins(root, model)) if v}


def retain(root: Root, model: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete versions, never a ``protected`` one; returns
    what was removed (version names, and the names of stale staging directories)."""
    removed = doomed(root, model, keep)
    for v in removed:
        shutil.rmtree(ms.version_dir(root, model, v))
    complete = ms.versions(root, model)
    for stale in ms.model_dir(root, model).glob(f"{ms.STAGING}*"):
        number = stale.name[len(ms.STAGING) :].split("-")[0]
        if complete and number.isdigit() and int(number) < int(complete[-1]):
            shutil.rmtree(stale, ignore_errors=True)
            removed.append(stale.name)
    return removed


def doomed(root: Root, model: str, keep: int) -> list[str]:
    """The versions ``retain(root, model, keep)`` would delete now: none once retention is done,
    though more than ``keep`` may be left (CURRENT, the one before it and the pins are kept
    beside the newest ``keep``, a version the gate refused among those)."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    keep_also = protected(root, model)
    complete = ms.versions(root, model)
    newest = set(complete[-keep:])
    return [
        v
        for v in ms.versions(root, model, complete_only=False)
        if v not in keep_also
        and v not in newest
        and (v in complete or (complete and int(v) < int(complete[-1])))
    ]
