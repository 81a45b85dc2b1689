"""Full versions from the stream: ``recserve train --follow ... --full-every 10m [--train-dense]``.

Deltas carry rows only, into the version being served, which keeps scoring with its own dense
network. A full version is how the rest ships: every ``--full-every`` (a time, ``600s``/``10m``/
``1h``, or a count of deltas, ``40d``) the follower, between two chunks,

1. cuts the pending rows as a last delta into the served version,
2. writes a new version (``write``): every shard's full dump with its optimizer state, the schema,
   the dense network in every runtime as ``recserve train``'s export writes it (verified against
   torch and timed: ``training.export_dense``), and its manifest, whose ``stream`` record
   (``model_store.StreamRecord``) holds the candidate's and the served version's progressive AUC on
   the same samples of the latest window; beside it ``stream/DELTA.json`` and the trained keys
   (``model_store.deltas``), where the stream resumes from the version before its first delta, so
   a restart from it trains each sample exactly once,
3. publishes it through the one gate (``model_store.publish``: checksums, schema and shape, and
   ``--max-auc-drop``: refused, logged and counted when the candidate's progressive AUC on the
   window falls below the served version's by more than that), and applies retention
   (``--keep-versions``: ``model_store.retention``). With ``--canary-share`` it is not published
   but started as an experiment's candidate arm, which the experiment's rule publishes or drops
   (``training.follow.canary``; a full version due while an experiment runs waits a period).

Once published, the follower reloads from the new version and cuts its next deltas into it
(``FollowTrainer._follow_current``); serving switches to it as to any published version (one
switch of CURRENT, lookups pinned to the dense model's version: no mixed responses). Refused, the
follower goes on cutting deltas into the served version and tries again one period later.

``--train-dense``: the dense network trains too, in the same step as the rows. Each batch is
scored by the candidate (trained) and by the served network (frozen: what serving scores with)
through one lookup and pooling (``Paired``): the two progressive scores the gate compares. Without
it the candidate is the served network and a full version just compacts the deltas.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor, nn

import model_store as ms
from features.schema import dump_schema
from model_store import runtimes
from model_store.deltas import STREAM, DeltaManifest, write_delta
from serving import memory
from training.ctx import DenseOptimizer
from training.evaluate import sigmoid
from training.export_dense import export_dense
from training.follow.canary import Canary
from training.follow.tally import Tally, clip
from training.follow.types import Score

if TYPE_CHECKING:
    from training.follow.book import StreamBook
    from training.follow.config import FollowConfig, Period

log = logging.getLogger("recserve.train.follow")

SAMPLE_ROWS = 256
"""Rows of the last batch kept to verify and time the dense export on."""


class Paired(nn.Module):
    """The candidate dense network beside the served one: ``forward`` gives both logits as rows of
    a (2, B) tensor, the served row without gradient, so one lookup and pooling score a batch with
    both (``served`` None: the candidate is the served network, frozen, scored once). Keeps the
    inputs of the last batch (``sample``, views: no copy) for the export's verification."""

    def __init__(self, candidate: nn.Module, served: nn.Module | None):
        super().__init__()
        self.candidate, self.served = candidate, served
        self.sample: tuple[Tensor, Tensor] | None = None

    def forward(self, pooled: Tensor, dense: Tensor) -> Tensor:
        self.sample = (pooled[:SAMPLE_ROWS].detach(), dense[:SAMPLE_ROWS])
        logits = self.candidate(pooled, dense)
        if self.served is None:
            return torch.stack([logits, logits.detach()])
        with torch.no_grad():
            served = self.served(pooled, dense)
        return torch.stack([logits, served])


class FrozenDense:
    """TrainCtx's dense optimizer for a frozen network: nothing to zero, nothing to step."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def step(self) -> None:
        pass


def load_frozen_dense(path: Path) -> nn.Module:
    """The served TorchScript dense network in eval mode with no trainable parameters: gradients
    still flow through it to the pooled embeddings (its inputs)."""
    from model_store.runtimes.torchscript import load_module

    module = load_module(path)
    for p in module.parameters():
        p.requires_grad_(False)
    return module


WINDOW_BINS = 1 << 14
"""Score bins of a full version's window (``training.follow.tally``): the gate's AUCs within
about 1/16,384 of the exact ones, in memory and work that do not grow with the period's samples."""


class _Window:
    """The two pre-training scores of the samples since the last full version, tallied per label.
    Kept sample by sample, the window held 12 bytes a sample and its exact AUCs sorted it at the
    full version on the training thread: at 12,000 samples/s and a 10-minute period, 7.2 million
    samples, about 2 s a score on an idle 2-vCPU VM, no delta cut meanwhile (the soak at 200 items
    a request)."""

    def __init__(self) -> None:
        self.candidate, self.served = Tally(WINDOW_BINS), Tally(WINDOW_BINS)

    def add(
        self, labels: NDArray[np.float32], candidate: NDArray[np.float32], served: NDArray[np.float32]
    ) -> None:
        clicked = labels > 0
        self.candidate.add(clicked, clip(candidate))
        self.served.add(clicked, clip(served))

    @property
    def samples(self) -> int:
        return self.candidate.samples

    def scores(self) -> tuple[Score, Score]:
        return _score(self.candidate), _score(self.served)


def _score(t: Tally) -> Score:
    auc, logloss = t.auc(), t.logloss()
    return Score(
        t.samples, None if auc is None else round(auc, 6), None if logloss is None else round(logloss, 6)
    )


class FullVersions:
    """When to write a full version, what it is judged by, writing and publishing it."""

    def __init__(self, cfg: FollowConfig, book: StreamBook, clock: Callable[[], float]):
        self.cfg, self.book, self.clock = cfg, book, clock
        assert cfg.full_period is not None
        self.period: Period = cfg.full_period
        self.window = _Window()
        self.published: list[str] = []
        self.refused: list[str] = []
        self._since, self._deltas = clock(), 0
        self._retention: threading.Thread | None = None
        self._warm = False  # a first export done (_warm_up)
        runtimes.preload()  # what the first full version's export imports, in memory from the start
        self._counter = self._retention_failures = None
        self.canary = (
            Canary(cfg.store, cfg.model, cfg.canary_share, cfg.max_auc_drop, self._count)
            if cfg.canary_share
            else None
        )  # --canary-share: each full version a canary (training.follow.canary)
        if book.registry is not None:
            from prometheus_client import Counter

            self._counter = Counter("recserve_follow_full_versions", "Full versions written, by outcome: published, "
                                    "refused; with --canary-share canaried, then canary_promoted, canary_dropped or "
                                    "canary_stopped.", ["outcome"], registry=book.registry)  # fmt: skip
            self._retention_failures = Counter(
                "recserve_follow_retention_failures", "Retention passes after a full version that failed "
                "(tried again after the next one; the store's disk use grows meanwhile).", registry=book.registry)  # fmt: skip

    # ---- the step ---------------------------------------------------------------------------------
    def dense(self, served: nn.Module, manifest: ms.VersionManifest) -> tuple[Paired, DenseOptimizer]:
        """The network to train through for a version whose served (frozen TorchScript) network is
        ``served``: a ``Paired`` candidate, built from the manifest's model config with the served
        weights, and its optimizer (Adam at ``--dense-lr``; none without ``--train-dense``)."""
        from training.models import ModelConfig, build_model

        if manifest.quantized is not None:
            raise ms.ModelStoreError(
                f"version {manifest.version} is served in {manifest.quantized.dtype}: full versions from the "
                "stream are written in float32 only (no test split here to measure a quantized one)"
            )
        config = ModelConfig.from_dict(manifest.model_config)
        candidate = build_model(config)
        own = candidate.state_dict()  # TorchScript saves non-persistent buffers too (DLRM's pair_index)
        candidate.load_state_dict({k: v for k, v in served.state_dict().items() if k in own})
        if not self._warm:
            self._warm_up(candidate, config, manifest.dense_runtime)
        if not self.cfg.train_dense:
            candidate.eval()
            for p in candidate.parameters():
                p.requires_grad_(False)
            return Paired(candidate, None), FrozenDense()
        candidate.train()
        return Paired(candidate, served), torch.optim.Adam(candidate.parameters(), lr=self.cfg.dense_lr)

    def _warm_up(self, candidate: nn.Module, config, timed: ms.RuntimeChoice | None) -> None:
        """Export ``candidate`` once into a scratch directory: a process's first export grows it by
        ~50 MB beyond the runtimes' modules (the exporters' and runtimes' first use), which would
        otherwise land at the first full version, minutes into a run (a soak's RSS step); a second
        export adds ~3 MB. Done at load, before the trainer reads (a standby: while it stands by)."""
        import tempfile

        t0 = time.monotonic()
        pooled = np.zeros((2, config.num_slots, config.dim), np.float32)
        with tempfile.TemporaryDirectory(prefix="recserve-warm-") as scratch:
            export_dense(
                candidate, Path(scratch), pooled, np.zeros((2, config.num_dense), np.float32), timed=timed
            )
        self._warm = True
        memory.trim()
        log.info("dense export warmed up in %.2f s", time.monotonic() - t0)

    def split(self, logits: Tensor, labels: NDArray[np.float32] | None) -> Tensor:
        """The candidate's logits of a ``Paired`` output; both scores of the batch join the window."""
        if labels is not None:
            scores = sigmoid(logits.detach().cpu().numpy())
            self.window.add(labels, scores[0], scores[1])
        return logits[0]

    def restart(self) -> None:
        """The period starts now (a standby taking over, as a restarted trainer)."""
        self._since, self._deltas = self.clock(), 0

    def due(self, deltas_cut: int) -> bool:
        """A period passed and samples were trained since the last full version (nothing new: no
        new version), and no experiment runs on the model with ``--canary-share`` (then the period
        and its window restart: one period later it is looked at again)."""
        if not self.window.samples or not self.period.due(
            self.clock() - self._since, deltas_cut - self._deltas
        ):
            return False
        if self.canary is not None and self.canary.busy():
            self._since, self._deltas, self.window = self.clock(), deltas_cut, _Window()
            return False
        return True

    # ---- the version -----------------------------------------------------------------------------
    def write(self, lv, positions: dict[str, int], deltas_cut: int) -> str:
        """Write the full version of what the follower holds now (``lv``: its ``training.follow.types.Loaded``, flushed,
        its last delta cut) and seal it; returns its name. The window closes."""
        self._since, self._deltas = self.clock(), deltas_cut
        (candidate, served), self.window = self.window.scores(), _Window()
        paired: Paired = lv.ctx.model
        if paired.sample is None:
            raise RuntimeError("a full version before any training step: nothing to verify its export on")
        root, model = self.cfg.store, self.cfg.model
        version = ms.next_version(root, model)
        d = ms.staging_dir(root, model, version)
        m: ms.VersionManifest = lv.manifest
        took = _Took()
        try:
            _dump_as(lv.cluster, d / "embeddings", version)  # rows and optimizer state, float32
            (d / "schema.yaml").write_text(dump_schema(lv.schema))
            took("shards")
            pooled, dense = (t.cpu().numpy() for t in paired.sample)
            exported = export_dense(paired.candidate, d, pooled, dense, timed=m.dense_runtime)
            took("dense")
            (d / STREAM).mkdir()
            record = DeltaManifest(
                self.book.source, positions, candidate.samples, 0, candidate.auc, candidate.logloss
            )
            write_delta(d / STREAM, record, self.book.keys.arrays() if self.book.keyed else None)
            took("keys")
            ms.write_manifest(d, ms.VersionManifest(
                model=model, version=version, parent=lv.version, schema_fingerprint=m.schema_fingerprint,
                model_config=m.model_config, dim=m.dim, num_shards=lv.cluster.num_shards,
                dense=exported.files, dense_runtime=exported.timing,
                metrics={"progressive_auc": candidate.auc, "served_progressive_auc": served.auc}
                | {f"{k}_max_abs_diff": v for k, v in exported.max_abs_diff.items()},
                stream=ms.StreamRecord(lv.version, candidate.samples, candidate.auc, served.auc),
            ))  # fmt: skip
            ms.seal(d, ms.version_dir(root, model, version))
            took("sealed")
        except BaseException:
            ms.discard(d)
            raise
        log.info("full version %s written from %s in %s: progressive AUC %s on %d samples (version %s: %s)",
                 version, lv.version, took, candidate.auc, candidate.samples, lv.version, served.auc)  # fmt: skip
        return version

    def publish(self, version: str) -> bool:
        """Publish ``version`` through the gate (``--canary-share``: start its canary instead),
        then apply retention; False when the gate (or the experiment store) refuses it, logged and
        counted, or when it went to a canary."""
        root, model = self.cfg.store, self.cfg.model
        self.settle()
        try:
            if self.canary is not None:
                self.canary.start(version)
                return False
            ms.publish(root, model, version, max_auc_drop=self.cfg.max_auc_drop)
        except ms.ModelStoreError as e:
            log.error(
                "full version %s refused by the gate%s: %s", version, " as a canary" if self.canary else "", e
            )
            self.refused.append(version)
            self._count("refused")
            return False
        finally:  # off the training thread: deleting a version's thousand deltas stalled the soak's
            # trainer 13 s (no delta cut) on the loaded 2-vCPU VM
            self._retention = threading.Thread(target=self._retain, name="retention", daemon=True)
            self._retention.start()
        log.info("full version %s published: CURRENT -> %s", version, version)
        self.published.append(version)
        self._count("published")
        return True

    def _count(self, outcome: str) -> None:
        if self._counter is not None:
            self._counter.labels(outcome).inc()

    def _retain(self) -> None:
        t0 = time.monotonic()
        try:
            removed = ms.retain(self.cfg.store, self.cfg.model, self.cfg.keep_versions)
        except (OSError, ms.ModelStoreError) as e:  # tried again after the next full version
            log.error("retention (--keep-versions %d) failed: %s", self.cfg.keep_versions, e)
            if self._retention_failures is not None:
                self._retention_failures.inc()
            return
        if removed:
            log.info("retention (--keep-versions %d): removed %s in %.1f s", self.cfg.keep_versions,
                     ", ".join(removed), time.monotonic() - t0)  # fmt: skip

    def settle(self) -> None:
        """Wait for the last retention to finish (before the next, and at the end)."""
        if self._retention is not None:
            self._retention.join()
            self._retention = None


class _Took:
    """Seconds per step of a full version's write, for its log line: "1.20 s (shards 0.31, ...)"."""

    def __init__(self) -> None:
        self.t0 = self.last = time.monotonic()
        self.steps: list[str] = []

    def __call__(self, step: str) -> None:
        now = time.monotonic()
        self.steps.append(f"{step} {now - self.last:.2f}")
        self.last = now

    def __str__(self) -> str:
        return f"{self.last - self.t0:.2f} s ({', '.join(self.steps)})"


def _dump_as(cluster, directory: Path, version: str) -> None:
    """Every shard's full dump, its meta naming ``version`` (the one the rows now belong to); the
    stores go on naming the version they cut deltas into (a refused version changes nothing)."""
    named = [s.version for s in cluster.stores]
    try:
        for store in cluster.stores:
            store.version = version
        cluster.dump(directory)
    finally:
        for store, v in zip(cluster.stores, named, strict=True):
            store.version = v
