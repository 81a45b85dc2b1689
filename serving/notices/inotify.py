"""``inotify``: notices from the kernel's file events on a model directory (one host, no Kafka).

The markers are written by ``model_store.layout.write_atomic`` (a temporary file renamed into
place), so a marker appearing is one ``IN_MOVED_TO`` event: ``<model>/CURRENT`` (a notice of the
version it names, delta_seq -1) and ``<model>/<version>/deltas/<seq>/_SUCCESS`` (a notice of that
delta). inotify is not recursive, so the listener watches the model directory, each version
directory, its ``deltas`` directory and each delta directory still without its ``_SUCCESS``
(unwatched once it has one: the watches stay as few as the versions); a directory that appears
is watched, then looked into, so a marker written before its watch existed is found too.

The kernel's events come at once (no pairing delay: ``watchdog`` holds every event 0.5 s to pair
renames, too slow for this). A shared disk written from another host (NFS) raises no event here:
the poll catches those up.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from serving.notices.hub import Notices
from serving.notices.record import VERSION, Notice
from serving.notices.registry import Transport, register

log = logging.getLogger("recserve.notices")


class InotifyListener:
    def __init__(self, model_dir: Path, notices: Notices):
        from inotify_simple import INotify, flags

        self.model_dir, self.notices = model_dir, notices
        self.flags = flags
        self._mask = flags.MOVED_TO | flags.CREATE | flags.CLOSE_WRITE | flags.ONLYDIR
        self._ino = INotify()
        self._paths: dict[int, Path] = {}  # watch descriptor -> directory
        self._stop = threading.Event()
        # a missing model directory is an OSError: the caller says so and polls only
        self._paths[self._ino.add_watch(model_dir, self._mask)] = model_dir
        for child in sorted(model_dir.iterdir()) if model_dir.is_dir() else []:
            if child.name.isdigit() and child.is_dir():
                self._found_dir(model_dir, child.name, announce=False)
        self._thread = threading.Thread(target=self._run, name="notices-inotify", daemon=True)
        self._thread.start()

    @property
    def listening(self) -> bool:
        return self._thread.is_alive()

    def _watch(self, path: Path) -> int | None:
        try:
            wd = self._ino.add_watch(path, self._mask)
        except FileNotFoundError:  # gone already (retention)
            return None
        self._paths[wd] = path
        return wd

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._ino.read(timeout=500)
            except (OSError, ValueError):  # closed under us
                return
            for event in events:
                try:
                    self._event(event)
                except OSError as e:  # a directory removed meanwhile: nothing to announce
                    log.debug("inotify event %s: %s", event, e)

    def _event(self, event) -> None:
        f = self.flags
        if event.mask & f.Q_OVERFLOW:  # the kernel dropped events: the poll catches up what they said
            log.warning("inotify queue overflowed on %s: notices lost until the next poll", self.model_dir)
            return
        if event.mask & f.IGNORED:  # the watch went (its directory was removed, or we removed it)
            self._paths.pop(event.wd, None)
            return
        where = self._paths.get(event.wd)
        if where is None or not event.name:
            return
        if event.mask & f.ISDIR:
            self._found_dir(where, event.name, announce=True)
        elif event.mask & (f.MOVED_TO | f.CLOSE_WRITE):
            self._found_file(where, event.name, event.wd)

    def _found_dir(self, parent: Path, name: str, announce: bool) -> None:
        """A directory appeared (or is there at the start): watch what may hold a marker, then
        look into it for what appeared before its watch."""
        path = parent / name
        depth = len(path.relative_to(self.model_dir).parts)  # 1 version, 2 deltas, 3 delta seq
        if depth == 1 and name.isdigit():
            self._watch(path)
            if (path / "deltas").is_dir():
                self._found_dir(path, "deltas", announce)
        elif depth == 2 and name == "deltas":
            self._watch(path)
            for seq in sorted((p for p in path.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
                self._found_dir(path, seq.name, announce)
        elif depth == 3 and name.isdigit():
            if (path / "_SUCCESS").is_file():  # complete already: announce it (new), else nothing
                if announce:
                    self._delta(path)
                return
            wd = self._watch(path)
            if (path / "_SUCCESS").is_file() and wd is not None:  # written between the check and the watch
                self._ino.rm_watch(wd)
                if announce:
                    self._delta(path)

    def _found_file(self, where: Path, name: str, wd: int) -> None:
        if where == self.model_dir and name == "CURRENT":
            version = (where / name).read_text().strip()
            if version:
                self.notices.deliver(
                    Notice(self.model_dir.name, version, VERSION, (where / name).stat().st_mtime)
                )
        elif name == "_SUCCESS" and len(where.relative_to(self.model_dir).parts) == 3:
            try:
                self._ino.rm_watch(wd)  # complete: nothing more to see there
            except OSError:
                pass
            self._delta(where)

    def _delta(self, ddir: Path) -> None:
        ts = (ddir / "_SUCCESS").stat().st_mtime
        self.notices.deliver(Notice(self.model_dir.name, ddir.parent.parent.name, int(ddir.name), ts))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        try:
            self._ino.close()
        except OSError:
            pass


def _check(where: str) -> None:
    if where:
        raise ValueError(
            f"--notices inotify takes no address (it watches the model directory), got inotify://{where}"
        )


def _listen(where: str, model_dir: Path, notices: Notices) -> InotifyListener:
    if not hasattr(os, "pipe2"):  # not Linux
        raise OSError("inotify needs Linux")
    return InotifyListener(model_dir, notices)


register(Transport("inotify", _listen, check=_check))
