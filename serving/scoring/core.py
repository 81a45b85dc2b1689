"""The scoring core: request bytes -> scores, with no TorchServe in sight.

Verbs (LitServe style): ``decode`` (a column-form JSON request read from its bytes by
``features.transform.from_json``, any other JSON via orjson, or a binary compact batch) -> ``predict``
(``features.transform`` — the training code, unchanged — then the embedding worker's
``Forward``, then the dense model) -> ``encode`` (scores in item order + the versions
that produced them). ``score`` runs the three and maps every failure to an HTTP status with a
JSON body ``{"error": "..."}`` naming the problem: 400/413/415 for the client's mistakes, 503 when
the worker or PS cannot answer in time, or when an embedding shard serves no version (the body
then names the shard and why: none published yet, or the version refused and the reason). Never a
200 from default rows. The TorchServe handler (``handlers/``) only adapts this.

A binary batch is checked against the served schema (``features.batch.check_fits``, the check the
worker runs too): another slot count or dense width is a 400 naming it, before any hop. A worker's
verdict keeps its class (``forward_status``): INVALID_ARGUMENT is a 400 with the worker's message,
unavailability a 503, anything else a 500 -- never "unavailable" for what is not.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import orjson

import model_store
from features.batch import BatchError, CompactBatch, check_fits
from features.codec import CodecError, decode, encode
from features.schema import Schema, load_schema
from features.transform import FeatureError, dense_matrix, from_json, transform
from model_store.dense import AUTO, CHOICES, check_runtime, runtime_of

log = logging.getLogger("recserve.scoring")

LOOKUPS = ("remote", "colocated", "auto")
JSON = "application/json"
BINARY = "application/octet-stream"


@dataclass
class ScoringConfig:
    """What a scoring process serves and its limits."""

    version_dir: str = field(default="", metadata={"cli": False})
    """model_store/<model>/<version>: schema.yaml, dense model, MANIFEST.json (a frontend that
    follows the store sets it to the version it loads)."""
    lookups: str = field(default="auto", metadata={"choices": ["auto", "colocated", "remote"]})
    """Where embedding rows are read: auto (per shard, mapped in this process where the version's
    files are on this host, through --ps elsewhere; through --worker when no shard is here, or when
    some are missing and --ps is not given), colocated (every shard mapped here: its files must be
    on this host) or remote (through --worker, or the PS shards of --ps)."""
    worker: str = "127.0.0.1:50060"
    """Embedding worker address (HOST:PORT) for remote lookups; several workers joined by | (a:1|b:1):
    each lookup goes to one of them and fails over to the next within its deadline."""
    ps: list[str] | None = None
    """PS shard addresses, shard i at entry i, a shard's replicas joined by | (a:1|a:2,b:1): the
    worker then runs as a library in this process over them (one process hop fewer than --worker)."""
    poll_s: float = 1.0
    """How often to look for new deltas of the served version (co-located shards) and new versions."""
    runtime: str = field(default=AUTO, metadata={"choices": CHOICES})
    """Dense runtime: auto serves the one the version's export measured faster (its manifest's
    dense_runtime; torchscript for versions exported before that)."""
    max_items: int = 1000
    """Items per scoring request (more: 413)."""
    max_body_bytes: int = 4 << 20
    """Request body limit in bytes (more: 413)."""
    worker_timeout_s: float = 1.0
    """Deadline of the embedding lookups of one request (worker call or PS calls)."""
    threads: int = 1
    """Intra-op threads of the dense runtime."""
    verify: bool = True
    """Check the checksums of the files the scorer reads (dense model, schema)."""
    tls_ca: str = ""
    """TLS to the worker or PS shards: the CA that signed their certificates (PEM; empty: plaintext)."""
    tls_cert: str = ""
    """mTLS: this process's client certificate (PEM)."""
    tls_key: str = ""
    """mTLS: this process's client key (PEM)."""

    def __post_init__(self) -> None:
        if self.ps == []:
            self.ps = None
        check_runtime(self.runtime)
        if self.lookups not in LOOKUPS:
            raise ValueError(f"unknown lookups {self.lookups!r}; choose one of {', '.join(LOOKUPS)}")
        from serving.worker.client import parse_workers

        parse_workers(self.worker)  # a malformed --worker is refused at start, not at the first version

    @classmethod
    def from_dict(cls, d: dict) -> ScoringConfig:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown scoring config keys: {sorted(unknown)}")
        return cls(**d)


class ScoringError(Exception):
    """A request that cannot be scored; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Scored:
    scores: np.ndarray  # probability per item, in request order
    versions: dict  # embedding version, delta seq, dense version
    timings_ms: dict = field(default_factory=dict)  # per stage, for the latency breakdown


class Inputs(NamedTuple):
    """The dense model's inputs of one request and what produced them."""

    pooled: np.ndarray  # (items, slots, dim) float32
    dense: np.ndarray  # (items, dense features) float32
    versions: dict  # embedding version, delta seq, dense version, per shard (version, seq)
    worker_ms: float  # the lookup's wall time


class Started(NamedTuple):
    """A request decoded and looked up, waiting for its dense stage (``Scorer.prepare``)."""

    t0: float  # perf_counter when it began
    decode_ms: float
    inputs: Inputs | None  # None: it failed before its lookup


def _probabilities(logits: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-np.asarray(logits, np.float64)))


class Reply(NamedTuple):
    status: int  # HTTP status
    payload: bytes  # JSON body
    timings: dict  # stage -> ms (decode, worker, dense, encode when scored; total always)
    versions: dict  # what answered (Scored.versions); empty when the request was not scored


class Scorer:
    """Loads one model version's schema and dense network; talks to one embedding worker."""

    def __init__(self, config: ScoringConfig, worker=None):
        self.config = config
        self._said_parsed = False  # a column-form request missed the compiled scan (logged once)
        vdir = Path(config.version_dir)
        self.manifest = model_store.read_manifest(vdir, verify=False)  # _SUCCESS and a readable manifest
        self.schema: Schema = load_schema(vdir / "schema.yaml")
        self.model = self.manifest.model
        self.dense_version = self.manifest.version
        self.runtime = runtime_of(self.manifest, config.runtime)
        """The dense runtime this scorer runs (``ScoringConfig.runtime`` resolved)."""
        rel = self.manifest.dense[self.runtime]
        if config.verify:  # the files this process reads; the embedding shards are the PS's to check
            model_store.verify_files(vdir, self.manifest, [rel, "schema.yaml"])
        self.dense = _load_dense(vdir / rel, config.threads)
        owned = worker is None  # built here: closed here if the warm-up fails
        if worker is None:
            from serving.scoring.lookups import lookup_backend

            worker, modes = lookup_backend(config, self.schema, self.manifest)
        else:
            modes = [
                "local" if getattr(s, "local", False) else "remote"
                for s in getattr(worker, "shards", [worker])
            ]
        self.lookup_modes = modes
        """Per embedding shard, where its rows are read: "local" (mapped here) or "remote"."""
        self.worker = worker
        from serving.worker.core import EmbeddingWorker

        self._inprocess = isinstance(self.worker, EmbeddingWorker)  # takes batches, not bytes
        try:
            self.warmup()
        except BaseException:
            if owned:  # its threads, mappings and channels
                self.close()
            raise

    def warmup(self, rounds: int = 3, patience_s: float = 60.0) -> None:
        """Run synthetic one-row requests (a list of records, and a ranking request in column form)
        through every stage, so compiled kernels, channels and the dense runtime are hot before the
        first real request (scores are discarded). A worker that is still cold may miss the
        deadline at first: retry for ``patience_s``, then fail."""
        slots = self.schema.slots
        value = {s.column: ("0" if s.kind != "dense" else 0.0) for s in slots}
        context = {s.column: value[s.column] for s in slots if s.scope == "context"}
        items = {s.column: [value[s.column]] for s in slots if s.scope == "item"}
        bodies = [orjson.dumps([value]), orjson.dumps({"context": context, "items": items})]
        deadline, done = time.monotonic() + patience_s, 0
        while done < rounds * len(bodies):
            status, payload = self.score(bodies[done % len(bodies)], JSON)
            if status == 200:
                done += 1
            elif status != 503 or time.monotonic() > deadline:
                raise RuntimeError(f"warm-up request failed ({status}): {payload.decode()[:300]}")
            else:  # a shard not serving the version yet: ask again shortly, not in a busy loop
                time.sleep(0.1)

    # --- verbs ---------------------------------------------------------------------------------
    def decode(self, body: bytes, content_type: str | None) -> CompactBatch:
        if len(body) > self.config.max_body_bytes:
            raise ScoringError(
                413, f"request body of {len(body)} bytes exceeds the limit of {self.config.max_body_bytes}"
            )
        if not body:
            raise ScoringError(400, "empty request body")
        ctype = (content_type or JSON).split(";")[0].strip().lower()
        if ctype == BINARY:
            try:
                batch = decode(body, schema_hash=self.schema.hash64)
                check_fits(batch, self.schema)
            except (CodecError, BatchError) as e:
                raise ScoringError(400, f"invalid compact batch: {e}") from None
            self._check_rows(batch.num_rows)
            return batch
        if ctype not in (JSON, "text/json", ""):
            raise ScoringError(415, f"unsupported content type {ctype!r}: send {JSON} or {BINARY}")
        scanned = from_json(body, self.schema, self.config.max_items)  # the column form, from its bytes
        if scanned is not None:
            return scanned
        try:  # any other body, or a mistake (named by orjson and transform)
            request = orjson.loads(body)
        except orjson.JSONDecodeError as e:
            raise ScoringError(400, f"malformed JSON: {e}") from None
        items = request.get("items") if isinstance(request, dict) else request
        if isinstance(items, list):
            self._check_rows(len(items))
        elif isinstance(items, dict):  # the column form: the longest column counts
            self._check_rows(max((len(v) for v in items.values() if isinstance(v, list)), default=0))
        try:
            batch = transform(request, self.schema)
        except FeatureError as e:
            raise ScoringError(400, str(e)) from None
        if isinstance(items, dict) and not self._said_parsed:  # a slower path a client can leave
            self._said_parsed = True
            log.warning("a column-form request was parsed by orjson: the compiled scan (features/jsonscan.py) "
                        "takes item strings of printable ASCII without escapes, numbers of at most 18 "
                        "significant digits and no item-scoped multi-valued slot; its decode takes about "
                        "half the time (said once per process)")  # fmt: skip
        return batch

    def lookup(self, batch: CompactBatch, body: bytes | None = None) -> Inputs:
        """The dense model's inputs of a decoded request: its pooled rows (read from the embedding
        version this dense model was exported with, never another) and its dense matrix."""
        t0 = time.perf_counter()
        # a worker process gets bytes (the client's own binary body when there is one); an
        # in-process EmbeddingWorker takes the batch itself
        payload = batch if self._inprocess else (body if body is not None else encode(batch))
        try:
            fwd = self.worker.forward(payload, version=self.dense_version)
        except Exception as e:
            raise ScoringError(*forward_status(e)) from None
        emb_version, delta_seq = fwd.version
        versions = {"embedding": emb_version, "delta_seq": int(delta_seq), "dense": self.dense_version,
                    "shards": [[v, q] for v, q in fwd.shards]}  # exactly what this request read  # fmt: skip
        return Inputs(
            fwd.pooled, dense_matrix(batch, self.schema), versions, (time.perf_counter() - t0) * 1e3
        )

    def logits(self, inputs: Sequence[Inputs]) -> list[np.ndarray]:
        """The dense model run once over several requests' inputs (a micro-batch: rows
        concatenated in order); each request's logits, in its item order."""
        if len(inputs) == 1:
            return [np.asarray(self.dense(inputs[0].pooled, inputs[0].dense))]
        out = np.asarray(self.dense(np.concatenate([i.pooled for i in inputs]),
                                    np.concatenate([i.dense for i in inputs])))  # fmt: skip
        return np.split(out, np.cumsum([len(i.pooled) for i in inputs])[:-1])

    def predict(self, batch: CompactBatch, body: bytes | None = None) -> Scored:
        inputs = self.lookup(batch, body)
        t1 = time.perf_counter()
        scores = _probabilities(self.logits([inputs])[0])
        dense_ms = (time.perf_counter() - t1) * 1e3
        return Scored(scores, inputs.versions, {"worker_ms": inputs.worker_ms, "dense_ms": dense_ms})

    def encode(self, scored: Scored) -> bytes:
        return orjson.dumps(
            {"model": self.model, "scores": scored.scores.tolist(), "versions": scored.versions},
            option=orjson.OPT_SERIALIZE_NUMPY,
        )

    # --- the whole path -------------------------------------------------------------------------
    def score(self, body: bytes, content_type: str | None = JSON) -> tuple[int, bytes]:
        """(HTTP status, JSON body) for one request. Never raises for a bad request."""
        status, payload, _ = self.score_timed(body, content_type)
        return status, payload

    def score_timed(self, body: bytes, content_type: str | None = JSON) -> tuple[int, bytes, dict]:
        """``score`` plus the wall time of each stage in ms: ``decode`` (orjson + transform),
        ``worker`` (Forward), ``dense``, ``encode`` and ``total`` (what a Server-Timing header says)."""
        r = self.reply(body, content_type)
        return r.status, r.payload, r.timings

    def reply(self, body: bytes, content_type: str | None = JSON) -> Reply:
        """Everything about one request: status, body, stage times in ms and the versions that
        answered (empty unless scored) -- what the handler reports as metrics."""
        started = self.prepare(body, content_type)
        return started if isinstance(started, Reply) else self.replies([started])[0]

    # --- one request in stages, for a frontend that batches the dense model (``reply`` is
    # prepare, then replies of one) --------------------------------------------------------------
    def replies(self, run: Sequence[Started]) -> list[Reply]:
        """The Replies of looked-up requests (``prepare``'s Started, all of this scorer) after ONE
        dense call over them all, in order; each Reply is the one ``reply`` gives that request
        alone. A failure of the dense call is every request's reply."""
        if not run:
            return []
        t0 = time.perf_counter()
        try:
            logits = self.logits([started.inputs for started in run])  # type: ignore[misc]
        except Exception as e:
            return [self.failed(started, e) for started in run]
        dense_ms = (time.perf_counter() - t0) * 1e3
        return [self.finish(started, lg, dense_ms) for started, lg in zip(run, logits, strict=True)]

    def prepare(self, body: bytes, content_type: str | None = JSON) -> Started | Reply:
        """Decode and look up one request: what its dense stage needs, or the Reply refusing it."""
        t0 = time.perf_counter()
        try:
            batch = self.decode(body, content_type)
            t1 = time.perf_counter()
            binary = (content_type or "").startswith(BINARY)
            return Started(t0, (t1 - t0) * 1e3, self.lookup(batch, body if binary else None))
        except Exception as e:
            return self.failed(Started(t0, 0.0, None), e)

    def finish(self, started: Started, logits: np.ndarray, dense_ms: float) -> Reply:
        """The Reply of a request whose dense stage (``dense_ms``, its micro-batch's) gave ``logits``."""
        assert started.inputs is not None
        try:
            t2 = time.perf_counter()
            scored = Scored(_probabilities(logits), started.inputs.versions)
            payload = self.encode(scored)
            t3 = time.perf_counter()
        except Exception as e:
            return self.failed(started, e)
        timings = {"decode": started.decode_ms, "worker": started.inputs.worker_ms, "dense": dense_ms,
                   "encode": (t3 - t2) * 1e3}  # fmt: skip
        timings["total"] = (t3 - started.t0) * 1e3
        return Reply(200, payload, timings, scored.versions)

    def failed(self, started: Started, e: Exception) -> Reply:
        """The Reply of a request that failed at any stage: the ScoringError's status and message;
        anything else is a 500 naming it (a bug, not the client's fault) and serving goes on."""
        if isinstance(e, ScoringError):
            status, payload = e.status, error_body(e.message)
        else:
            status, payload = 500, error_body(f"internal error: {_short(e)}")
        return Reply(status, payload, {"total": (time.perf_counter() - started.t0) * 1e3}, {})

    def _check_rows(self, n: int) -> None:
        if n > self.config.max_items:
            raise ScoringError(413, f"{n} items exceed the limit of {self.config.max_items} per request")

    def close(self) -> None:
        close = getattr(self.worker, "close", None)
        if close:
            close()


def server_timing(timings_ms: dict) -> str:
    """An HTTP ``Server-Timing`` header value: ``decode;dur=1.234, worker;dur=0.9, ...``."""
    return ", ".join(f"{name};dur={ms:.3f}" for name, ms in timings_ms.items())


@contextlib.contextmanager
def loading_priority(niceness: int = 10):
    """Load a model (imports, checksums, warm-up) at low CPU priority, then serve at normal priority.

    A new version loading beside the serving one must not take its CPU: on a small machine the
    load otherwise stalls live requests for seconds. ``recserve up`` starts TorchServe's Python
    workers niced already (their start-up imports come before the handler runs); this keeps the
    handler's own loading niced and then returns the process to niceness 0. That needs
    CAP_SYS_NICE; without it the process keeps the lower priority and says so."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(os.getpriority(os.PRIO_PROCESS, 0), niceness))
    except OSError:
        pass
    try:
        yield
    finally:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
        except OSError as e:
            log.warning(
                "serving at niceness %d: cannot return to 0 after loading (%s)",
                os.getpriority(os.PRIO_PROCESS, 0),
                e,
            )


def forward_status(e: Exception) -> tuple[int, str]:
    """(HTTP status, message) for a failed worker Forward (a ``WorkerClient``'s or an in-process
    worker's exception), classified by ``serving.rpc.errors.status_of`` like every gRPC error:
    the client's mistake is a 400 with the worker's own message; a shard serving no version a 503
    naming it and why; an unreachable or late worker or shard a 503; anything else a 500."""
    import grpc

    from serving.rpc.errors import status_of

    if getattr(e, "not_serving", False):  # a shard without its version: which, and why
        return 503, str(e)
    code, _ = status_of(e, "Forward")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        details = getattr(e.__cause__, "details", None)  # the worker's words, not the client's wrapping
        return 400, details() if callable(details) else str(e)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return 503, f"embedding worker unavailable: {_short(e)}"
    return 500, f"embedding worker failed: {_short(e)}"


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})


def _short(e: Exception) -> str:
    text = getattr(e, "details", None)
    text = text() if callable(text) else str(e)
    return f"{type(e).__name__}: {text}"[:300]


def _load_dense(path: Path, threads: int):
    import torch

    from model_store.dense import load_dense

    torch.set_num_threads(threads)
    return load_dense(path, num_threads=threads)
