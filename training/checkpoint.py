"""Training checkpoints: what a killed run restarts from (``recserve train --resume``).

A checkpoint is a directory beside the model's versions, never a version itself::

    <store>/<model>/checkpoints/step-<N>/
        checkpoint.json        step, epoch, position in the epoch, world size, what must match
        dense.pt               the dense network's weights and its optimizer's state (rank 0)
        rank-<r>.pt            every rank's torch RNG state
        ps/shard-<i>-of-<n>/   every PS shard's full dump: rows, optimizer state, counts
        _SUCCESS               written last

It is written into ``.step-<N>.tmp`` and renamed when every rank and shard has written its part
(``model_store.seal``), so a reader sees a whole checkpoint or none; the newest ``keep`` are kept.
Taking one is collective: every rank flushes its sparse updates, rank 0 dumps the shards (their
dumps must lie under the shards' data root: the store root for the shards a job starts, and the
store docs/hosts.md mounts on every host for standalone ones).

A restart replays: the shards and the dense network go back to the checkpoint, and every rank
reads its part of the data again from the checkpoint's position (the same shuffle: the order is
seeded by seed, epoch and rank), so the samples trained after the checkpoint are trained again
(at least once); deltas cut after it into the lost run's staging version are gone with it.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from model_store.layout import SUCCESS, model_dir
from model_store.manifest import seal

log = logging.getLogger("recserve.train")

__all__ = ["Checkpoint", "Checkpointer", "Every", "latest", "parse_every"]

_NAME = re.compile(r"step-(\d+)")
# what the data position means: a resumed run with another value would read other batches
MUST_MATCH = (
    "data",
    "schema",
    "limit",
    "batch_size",
    "shuffle_buffer",
    "seed",
    "arch",
    "table.dim",
    "epochs",
)


@dataclass(frozen=True)
class Every:
    """When checkpoints are due: every ``steps`` steps or every ``seconds`` (0: never)."""

    steps: int = 0
    seconds: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.steps > 0 or self.seconds > 0


def parse_every(text: str) -> Every:
    """``"500"`` (steps), ``"300s"``, ``"5m"`` or ``""``/``"0"`` (never); ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h)?\s*", text or "0")
    if not m:
        raise ValueError(f"--checkpoint-every {text!r}: give steps (500) or a time (300s, 10m, 1h)")
    value, unit = float(m.group(1)), m.group(2)
    if unit is None:
        if value != int(value):
            raise ValueError(f"--checkpoint-every {text!r}: a step count is a whole number")
        return Every(steps=int(value))
    return Every(seconds=value * {"s": 1, "m": 60, "h": 3600}[unit])


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint on disk."""

    path: Path
    meta: dict

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    def check(self, world: int, config: dict) -> None:
        """Refuse to resume a run that would read other data at the saved position."""
        if self.meta["world_size"] != world:
            raise ValueError(
                f"{self.path}: written by {self.meta['world_size']} ranks, resumed with {world}: every rank's "
                "data position belongs to its part of the data; resume with the same number of ranks"
            )
        saved = self.meta["config"]
        differ = [
            f"{k}: {_at(saved, k)!r} -> {_at(config, k)!r}"
            for k in MUST_MATCH
            if _at(saved, k) != _at(config, k)
        ]
        if differ:
            raise ValueError(
                f"{self.path}: the run resumed differs from the one checkpointed ({'; '.join(differ)})"
            )

    def rank_state(self, rank: int) -> dict:
        return torch.load(self.path / f"rank-{rank}.pt", weights_only=False)

    def dense_state(self) -> dict:
        return torch.load(self.path / "dense.pt", weights_only=False)


def _at(config: dict, dotted: str) -> object:
    """``config``'s value at a dotted key (a nested config's field), None where there is none."""
    value: object = config
    for key in dotted.split("."):
        value = value.get(key) if isinstance(value, dict) else None
    return value


def checkpoint_dir(store: str | Path, model: str, override: str = "") -> Path:
    return Path(override) if override else model_dir(store, model) / "checkpoints"


def latest(directory: str | Path) -> Checkpoint | None:
    """The newest complete checkpoint (``_SUCCESS`` present) in ``directory``, or None."""
    found = []
    for p in Path(directory).glob("step-*"):
        m = _NAME.fullmatch(p.name)
        if m and (p / SUCCESS).is_file():
            found.append((int(m.group(1)), p))
    if not found:
        return None
    _, path = max(found)
    return Checkpoint(path, json.loads((path / "checkpoint.json").read_text()))


class Checkpointer:
    """Takes the checkpoints of one run: ``due`` after every step, ``save`` when it says so (on
    every rank: ``sync`` is a barrier across ranks, ``agree`` makes every rank's decision rank
    0's). ``cluster`` dumps the shards; ``keep``: how many complete checkpoints stay."""

    def __init__(
        self,
        directory: Path,
        every: Every,
        keep: int,
        rank: int,
        world: int,
        sync,
        agree,
        clock=time.monotonic,
    ):
        if keep < 1:
            raise ValueError("--checkpoint-keep must be >= 1")
        self.directory, self.every, self.keep = Path(directory), every, keep
        self.rank, self.world, self.sync, self.agree, self.clock = rank, world, sync, agree, clock
        self._last = clock()
        self.written: list[Path] = []

    def due(self, step: int) -> bool:
        if self.every.steps:
            return step % self.every.steps == 0
        if self.every.seconds:  # the clocks of the ranks differ: rank 0's decides
            return self.agree(self.clock() - self._last >= self.every.seconds)
        return False

    def save(
        self, step: int, epoch: int, in_epoch: int, cluster, model, optimizer, extra: dict, config: dict
    ) -> Path | None:
        """Write checkpoint ``step`` (every rank calls this after flushing its sparse updates)."""
        t0 = time.perf_counter()
        staging = self.directory / f".step-{step}.tmp"
        final = self.directory / f"step-{step}"
        if self.rank == 0:
            shutil.rmtree(staging, ignore_errors=True)  # a run killed while writing it
            staging.mkdir(parents=True)
        self.sync()
        torch.save({"torch_rng": torch.get_rng_state()}, staging / f"rank-{self.rank}.pt")
        if self.rank == 0:
            if cluster is not None:
                cluster.dump(staging / "ps")
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **extra},
                staging / "dense.pt",
            )
        self.sync()  # every rank's part is on disk
        path = None
        if self.rank == 0:
            meta = {"step": step, "epoch": epoch, "in_epoch": in_epoch, "world_size": self.world,
                    "created": time.time(), "config": config}  # fmt: skip
            (staging / "checkpoint.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
            if final.exists():  # the same step again after a resume: the new one replaces it
                shutil.rmtree(final)
            path = seal(staging, final)
            self.written.append(path)
            self._prune()
            log.info("checkpoint %s written in %.2fs", path, time.perf_counter() - t0)
        self._last = self.clock()
        return path

    def _prune(self) -> None:
        done = sorted(
            (int(m.group(1)), p)
            for p in self.directory.glob("step-*")
            if (m := _NAME.fullmatch(p.name)) and (p / SUCCESS).is_file()
        )
        for _, p in done[: -self.keep]:
            shutil.rmtree(p, ignore_errors=True)
