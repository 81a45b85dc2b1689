"""Impressions on local disk until their attribution window ends: what lets ``recserve join
--attribution-s`` keep a request past its first horizon without its rows in memory.

A partition's join writes each impression (the record as read) when it opens the request, to a
segment file of the time bucket its attribution window ends in (``bucket_s`` wide), and a
correction reads it back from there (one ``pread``). A segment is deleted once the watermark has
passed its bucket: every request in it is over. Appends and reads are plain ``os.write`` and
``os.pread`` on descriptors kept open, so a read sees every write before it.

With ``keep`` a spill opens the segments a run before left, which ``stream.journal`` says what
they hold; without, it starts empty.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stream.config import JoinConfig


class Spill:
    def __init__(self, directory: Path, bucket_s: float, keep: bool = False) -> None:
        if not bucket_s > 0:
            raise ValueError(f"bucket_s must be > 0, got {bucket_s}")
        self.dir, self.bucket_s = Path(directory), bucket_s
        self._fds: dict[int, int] = {}  # bucket -> descriptor (read and append)
        self._sizes: dict[int, int] = {}
        if not keep:
            self.clear()
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        for seg in self.dir.glob("*.seg"):  # what a run before left (``stream.journal`` says where)
            bucket = int(seg.stem)
            self._fds[bucket] = os.open(seg, os.O_RDWR | os.O_APPEND)
            self._sizes[bucket] = os.fstat(self._fds[bucket]).st_size

    def clear(self) -> None:
        """Forget everything (a partition's join starts empty)."""
        self.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True)

    def put(self, ends: float, value: bytes) -> tuple[int, int, int]:
        """Keep ``value`` until event time ``ends``; where it lies, for ``get``."""
        bucket = math.floor(ends / self.bucket_s)
        fd = self._fds.get(bucket)
        if fd is None:
            fd = os.open(self.dir / f"{bucket}.seg", os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
            self._fds[bucket], self._sizes[bucket] = fd, 0
        at = self._sizes[bucket]
        os.write(fd, value)
        self._sizes[bucket] = at + len(value)
        return bucket, at, len(value)

    def get(self, where: tuple[int, int, int]) -> bytes | None:
        """The value ``put`` returned ``where`` for (None: its bucket is gone)."""
        bucket, at, size = where
        fd = self._fds.get(bucket)
        return None if fd is None else os.pread(fd, size, at)

    def expire(self, watermark: float) -> None:
        """Delete the segments whose bucket ended at or before ``watermark``."""
        for bucket in [b for b in self._fds if (b + 1) * self.bucket_s <= watermark]:
            os.close(self._fds.pop(bucket))
            del self._sizes[bucket]
            (self.dir / f"{bucket}.seg").unlink(missing_ok=True)

    @property
    def bytes(self) -> int:
        """What the segments hold now."""
        return sum(self._sizes.values())

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._sizes.clear()


def spill_root(cfg: JoinConfig) -> Path | None:
    """The partitions' state directory: --state-dir, or <tmp>/recserve-join/<group> (None: no
    --attribution-s past --label-after-s, nothing spilled)."""
    if not cfg.attribution_s > cfg.label_after_s:
        return None
    root = Path(cfg.state_dir or Path(tempfile.gettempdir()) / "recserve-join" / cfg.group)
    root.mkdir(parents=True, exist_ok=True)
    return root
