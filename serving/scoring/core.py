"""The scoring core: request bytes -> scores, with no HTTP server in sight.

One ``Scorer`` per served version, with four verbs (LitServe style): ``decode`` (a binary compact
batch, or JSON: ``serving.scoring.decoding``) -> ``lookup`` (the embedding worker's
``Forward``, pinned to this version: ``serving.scoring.lookups``) -> ``predict`` (the
dense model, once over one or more requests) -> ``encode`` (scores in item order + the versions
that produced them). The verbs raise what they find; ``serving.scoring.loop`` is the one request
loop that runs them (single or micro-batched) and times each stage, and each frontend (the
TorchServe handler in ``handlers/``, ``recserve serve`` in ``serving.scoring.lean``) maps errors
once, at its boundary, by ``serving.scoring.errors``: 400/413/415 for the client's mistakes, 503
when the worker or PS cannot answer in time or an embedding shard serves no version (naming the
shard and why), a 500 naming anything else. Never a 200 from default rows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import orjson

import model_store
from features.schema import Schema, load_schema
from features.transform import dense_matrix
from model_store.devices import CPU, DenseChoice, choose
from serving.scoring.config import ScoringConfig
from serving.scoring.decoding import BINARY, JSON, Decoder, Request, warmup_requests
from serving.scoring.errors import status_of
from serving.scoring.lookups import Lookups

if TYPE_CHECKING:
    from serving.notices import Notices

__all__ = ["BINARY", "JSON", "Inputs", "Scorer", "server_timing"]

log = logging.getLogger("recserve.scoring")


class Inputs(NamedTuple):
    """The dense model's inputs of one request and what produced them."""

    pooled: np.ndarray  # (items, slots, dim) float32
    dense: np.ndarray  # (items, dense features) float32
    versions: dict[str, Any]  # embedding version, delta seq, dense version, per shard (version, seq)


class Scorer:
    """Loads one model version's schema and dense network; reads rows through one embedding
    worker. Four verbs: ``decode`` -> ``lookup`` -> ``predict`` (one or more requests at once) ->
    ``encode``; ``serving.scoring.loop`` runs them for the frontends."""

    def __init__(self, config: ScoringConfig, worker: Any = None, notices: Notices | None = None):
        """``notices``: the process's notices of the model, which its co-located shards follow
        (None: they open their own, ``config.notices``)."""
        self.config = config
        vdir = Path(config.version_dir)
        self.manifest = model_store.read_manifest(vdir, verify=False)  # _SUCCESS and a readable manifest
        self.schema: Schema = load_schema(vdir / "schema.yaml")
        self.model = self.manifest.model
        self.dense_version = self.manifest.version
        if config.verify and config.device != CPU:  # choosing for a GPU loads every dense file to time it
            model_store.verify_files(vdir, self.manifest, sorted(set(self.manifest.dense.values())))
        self.choice: DenseChoice = choose(self.manifest, vdir, config.device, config.runtime, config.threads)
        """The dense runtime this scorer runs and its device (``--runtime``/``--device`` resolved)."""
        self.runtime = self.choice.runtime
        log.info("dense model of version %s: %s on the %s (%s)", self.dense_version, self.runtime,
                 self.choice.device, self.choice.why)  # fmt: skip
        rel = self.manifest.dense[self.choice.source]
        if config.verify:  # the files this process reads; the embedding shards are the PS's to check
            model_store.verify_files(vdir, self.manifest, [rel, "schema.yaml"])
        self.dense = _load_dense(self.runtime, vdir / rel, config.threads)
        self.decoder = Decoder(self.schema, config.max_items, config.max_body_bytes)
        owned = worker is None  # built here: closed here if the warm-up fails
        if worker is None:
            self.lookups = Lookups.of(config, self.schema, self.manifest, notices)
        else:
            self.lookups = Lookups.over(worker)
        try:
            self.warmup()
        except BaseException:
            if owned:  # its threads, mappings and channels
                self.close()
            raise

    @property
    def lookup_modes(self) -> list[str]:
        """Per embedding shard, where its rows are read: "colocated" (mapped here) or "remote"."""
        return self.lookups.modes

    def warmup(self, rounds: int = 3, patience_s: float = 60.0) -> None:
        """Run synthetic one-row requests (a list of records, a ranking request in column form, and
        its codec bytes) through every verb, so compiled kernels, channels and the dense runtime are
        hot before the first real request (scores are discarded). A worker that is still cold may miss the
        deadline at first: retry for ``patience_s``, then fail."""
        bodies = warmup_requests(self.decoder)
        deadline, done = time.monotonic() + patience_s, 0
        while done < rounds * len(bodies):
            try:
                inputs = self.lookup(self.decode(*bodies[done % len(bodies)]))
                self.encode(self.predict([inputs])[0], inputs.versions)
                done += 1
            except Exception as e:
                status, message = status_of(e)
                if status != 503 or time.monotonic() > deadline:
                    raise RuntimeError(f"warm-up request failed ({status}): {message[:300]}") from e
                time.sleep(0.1)  # a shard not serving the version yet: ask again shortly

    # --- verbs ---------------------------------------------------------------------------------
    def decode(self, body: bytes, content_type: str | None) -> Request:
        """A request's batch, checked against the schema and the limits (``Decoder``)."""
        return self.decoder.decode(body, content_type)

    def lookup(self, request: Request) -> Inputs:
        """The dense model's inputs of a decoded request: its pooled rows (read from the embedding
        version this dense model was exported with, never another) and its dense matrix."""
        fwd = self.lookups.forward(request, self.dense_version)
        emb_version, delta_seq = fwd.version
        versions = {"embedding": emb_version, "delta_seq": int(delta_seq), "dense": self.dense_version,
                    "shards": [[v, q] for v, q in fwd.shards]}  # exactly what this request read  # fmt: skip
        return Inputs(fwd.pooled, dense_matrix(request.batch, self.schema), versions)

    def predict(self, inputs: Sequence[Inputs]) -> list[np.ndarray]:
        """Each request's probabilities, in its item order, from ONE run of the dense model over
        them all (a micro-batch: rows concatenated in order)."""
        if len(inputs) == 1:
            return [_probabilities(self.dense(inputs[0].pooled, inputs[0].dense))]
        out = _probabilities(self.dense(np.concatenate([i.pooled for i in inputs]),
                                        np.concatenate([i.dense for i in inputs])))  # fmt: skip
        return np.split(out, np.cumsum([len(i.pooled) for i in inputs])[:-1])

    def encode(self, scores: np.ndarray, versions: dict[str, Any]) -> bytes:
        """The JSON body of a scored request: the model, its scores and the versions that answered."""
        return orjson.dumps(
            {"model": self.model, "scores": scores.tolist(), "versions": versions},
            option=orjson.OPT_SERIALIZE_NUMPY,
        )

    def close(self) -> None:
        self.lookups.close()


def server_timing(timings_ms: dict[str, float]) -> str:
    """An HTTP ``Server-Timing`` header value: ``decode;dur=1.234, worker;dur=0.9, ...``."""
    return ", ".join(f"{name};dur={ms:.3f}" for name, ms in timings_ms.items())


def _probabilities(logits: Any) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))


def _load_dense(runtime: str, path: Path, threads: int) -> Any:
    import torch

    from model_store import runtimes

    torch.set_num_threads(threads)
    return runtimes.get(runtime).load(path, threads)
