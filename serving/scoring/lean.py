"""``recserve serve``: the lean scoring frontend -- the scoring core behind uvicorn (uvloop, httptools).

The same API as the TorchServe endpoint, over the same ``Scorer``: ``POST /predictions/<model>``
(JSON or a binary compact batch; scores in item order + the versions that answered; the core's
statuses: 400/413/415 for the client's mistakes, 503 naming what is unavailable, never a 200 from
default rows), ``GET /ping`` (200 ``{"status": "Healthy"}`` while a version is served, else 503
naming why), ``GET /metrics`` (Prometheus: the scoring metrics TorchServe's handler reports, plus
the lookup mode of every shard, the served version and the refusals; with ``--log-impressions``
the impressions logged and dropped). Every response carries an ``X-Request-Id`` header: the
client's, else a new one (the impression's key, ``serving.scoring.impressions``). Token auth is on by default
(``Authorization: Bearer <key>``, the key in a TorchServe-style key file, so ``recserve score
--key-file`` works with either frontend); HTTPS with ``--https-cert``/``--https-key``; SIGTERM
drains: uvicorn stops accepting, lets the requests in flight finish, then the process exits.

The frontend follows the model store itself (no controller), as TorchServe's handler can
(``serving.scoring.follow.ScorerFollower``, run on a thread of its own beside the event loop): at
each notice of a new CURRENT (``--notices``: ``serving.notices``, which also wake its co-located
shards for each delta) and every ``poll_s`` anyway, it reads CURRENT (or serves ``--version``); a
new version passes the one gate (``model_store.validate`` against the served manifest), then a new
``Scorer`` loads beside the serving one -- mapping its co-located shards, and warming up until
every remote shard holds the version -- and replaces it in one reference assignment. Each scorer
pins its lookups to its own version, and a request uses one scorer from start to end, so no
response mixes versions. The replaced scorer is closed after ``drain_s``. A version the gate or
the load refuses is skipped (logged, counted, and named by ``/ping`` while nothing is served);
serving stays on what it has.

With ``--workers N`` (default ``auto``: one per CPU this process may use) a parent binds the port
and keeps N such processes serving it (``serving.scoring.processes``), with one ``/metrics`` for
them all (``serving.scoring.multiproc``); ``--workers 1`` is ``serve``: this process alone. Every
process is listed by ``recserve versions`` while it runs (``serving.scoring.roster``).

This module is the process (its config, its key, the follower of the store and its metrics);
``serving.scoring.asgi`` is its HTTP face (the routes, the error boundary, micro-batching).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import model_store as ms
from model_store.dense import RUNTIMES
from serving.scoring.arms import Router, Split, arm_of
from serving.scoring.asgi import PREDICTIONS, App
from serving.scoring.config import ScoringConfig
from serving.scoring.core import Scorer
from serving.scoring.errors import Reply
from serving.scoring.follow import ScorerFollower
from serving.scoring.impressions import ImpressionLog
from serving.scoring.multiproc import GAUGE_MODE, reset
from serving.scoring.names import (
    ARM_MAPPED,
    ARM_REQUESTS,
    DENSE_DEVICE,
    DENSE_DEVICES,
    DENSE_RUNTIME,
    LOOKUP_MODE,
    LOOKUP_MODES,
)

if TYPE_CHECKING:
    import socket

    from prometheus_client import CollectorRegistry

    from serving.scoring.roster import FrontendRecord

log = logging.getLogger("recserve.serve")


def workers_flag(value: str) -> str:
    """``--workers``: a number of processes >= 1, or ``auto``."""
    if value == "auto":
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a number of processes: give N >= 1 or auto"
        ) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: give at least 1 process, or auto (one per CPU)")
    return str(n)


@dataclass
class ServeConfig:
    """The lean scoring frontend (``recserve serve``)."""

    store: str = field(default_factory=ms.default_root)
    """Model-store root ($RECSERVE_STORE or ./artifacts)."""
    model: str = "criteo"
    """Model name in the store (the endpoint is /predictions/<model>)."""
    version: str = ""
    """Serve this version (and its deltas) instead of following CURRENT ('' follows CURRENT)."""
    host: str = "127.0.0.1"
    """Interface to bind (loopback unless told otherwise)."""
    port: int = 8080
    """HTTP port."""
    workers: str = field(default="auto", metadata={"type": workers_flag, "metavar": "N|auto"})
    """Processes serving the port (auto: one per CPU this process may use: its affinity, capped by
    a container's CPU limit). With more than one, a parent binds the port, restarts a worker that
    dies and drains them all on SIGTERM; 1 is this process alone. (Not --worker, the embedding
    worker of remote lookups.)"""
    key_file: str = ""
    """Token file ({"inference": {"key": ...}}, as TorchServe writes; created with a fresh key when
    missing). '' = <store>/.run/<model>/serve-key_file.json."""
    disable_token_auth: bool = field(default=False, metadata={"flag": "no-token-auth"})
    """Turn token auth OFF (it is on by default; serve says which)."""
    https_cert: str = ""
    """Serve HTTPS with this certificate (PEM); needs --https-key."""
    https_key: str = ""
    """The HTTPS private key (PEM, mode 600)."""
    batch_wait_ms: float = 1.0
    """Micro-batching of the dense stage: when requests queue, those whose lookups are done run the
    dense model together, waiting at most this long for the others in progress (a request alone
    never waits); 0 turns it off (each request runs the dense model by itself)."""
    batch_max_items: int = 2048
    """Most items in one micro-batch: it runs as soon as it holds this many, and a request that
    would take it past them goes into the next."""
    drain_s: float = 2.0
    """After a version switch, how long the replaced scorer keeps its resources for requests in
    flight; on SIGTERM, how long requests in flight may take to finish."""
    scoring: ScoringConfig = field(default_factory=ScoringConfig)
    """The scoring core (its version_dir is set to the version loaded)."""

    def __post_init__(self) -> None:
        try:
            self.workers = workers_flag(str(self.workers))
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"--workers {e}") from None
        if self.batch_wait_ms < 0 or self.batch_max_items < 1:
            raise ValueError("--batch-wait-ms must be >= 0 and --batch-max-items >= 1")
        if bool(self.https_cert) != bool(self.https_key):
            raise ValueError("--https-cert and --https-key go together")
        if self.https_cert:  # the files, the key's mode and the pair: checked as for gRPC's TLS
            from serving.rpc.tls import ServerTLS

            ServerTLS(self.https_cert, self.https_key)

    def worker_count(self) -> int:
        from serving.rpc.procs import usable_cpus

        return usable_cpus() if self.workers == "auto" else int(self.workers)

    def key_path(self) -> Path:
        return (
            Path(self.key_file)
            if self.key_file
            else Path(self.store) / ".run" / self.model / "serve-key_file.json"
        )


def inference_key(path: Path) -> str:
    """The inference key in ``path``; a fresh one written there (mode 600) when the file is missing."""
    from serving.rpc.auth import read_secret

    if not path.exists():  # written whole, then linked: a frontend starting beside reads all or nothing
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"inference": {"key": secrets.token_urlsafe(24)}}, f)
        try:
            os.link(tmp, path)
        except FileExistsError:  # another one made it first: use theirs
            pass
        finally:
            tmp.unlink()
    try:
        key = json.loads(read_secret(path, "key file"))["inference"]["key"]
    except (KeyError, TypeError, json.JSONDecodeError):
        key = None
    if not isinstance(key, str) or not key:  # an empty key must not turn token auth off
        raise ValueError(f'key file {path} has no inference key ({{"inference": {{"key": "..."}}}})')
    return key


class Frontend:
    """The follower of the store (its served ``Scorer``, None until a version loads) and its metrics."""

    def __init__(self, config: ServeConfig, registry: CollectorRegistry | None = None):
        """``registry``: where its metrics go (a worker's, ``serving.scoring.multiproc``; None: its own)."""
        from functools import partial

        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        from serving.rpc.metrics import LATENCY_BUCKETS

        self.config = config
        self.token = "" if config.disable_token_auth else inference_key(config.key_path())
        self.registry = r = registry if registry is not None else CollectorRegistry()
        gauge = partial(Gauge, registry=r, multiprocess_mode=GAUGE_MODE)  # a worker's: see multiproc
        self.requests = Counter("recserve_scoring_requests", "Scoring requests by HTTP status and the versions that answered",
                                ["model", "status", "dense_version", "embedding_version"], registry=r)  # fmt: skip
        self.stages = Histogram("recserve_scoring_stage_seconds", "Time of each scoring stage", ["stage"],
                                buckets=LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.served = gauge(
            "recserve_scoring_version", "1 for the dense version served", ["model", "version"]
        )
        self.modes = gauge(
            LOOKUP_MODE, "Where each embedding shard's rows are read (1 = this mode)", ["shard", "mode"]
        )
        self.runtime = gauge(DENSE_RUNTIME, "The dense runtime that scores (1 = this runtime)", ["runtime"])
        self.device = gauge(DENSE_DEVICE, "Where the dense model runs (1 = this device)", ["device"])
        self.batched = Histogram("recserve_scoring_dense_batch_requests", "Requests per run of the dense model "
                                 "(micro-batching)", buckets=(1, 2, 3, 4, 6, 8, 16, 32), registry=r)  # fmt: skip
        self.follower = ScorerFollower(config.store, config.model, config.scoring, pin=config.version,
                                       drain_s=config.drain_s, registry=r)  # fmt: skip
        self.follower.on_switch = self._show
        self.impressions: ImpressionLog | None = None
        """The impression log (--log-impressions), one for every version this process serves."""
        if config.scoring.log_impressions:
            self.impressions = ImpressionLog(config.scoring.log_impressions)
            r.register(self.impressions)
        self.arm_requests = Counter(ARM_REQUESTS[: -len("_total")], "Requests each arm of a running experiment "
                                    "answered (shadow arms' too), by HTTP status", ["arm", "status"], registry=r)  # fmt: skip
        self.arm_mapped = gauge(ARM_MAPPED, "Bytes of embedding rows each arm's scorer holds in this process",
                                ["arm", "version"])  # fmt: skip
        self.follower.arms.on_split = self._show_split
        self.router = Router(self.follower, self.impressions)
        """Each request to its scorer: CURRENT's, or its arm's while an experiment runs."""
        self.router.shadows.on_reply = self._count_arm
        r.register(self.router.shadows)

    @property
    def scorer(self) -> Scorer | None:
        """The served scorer (None until a version loads): take it once per request."""
        return self.follower.scorer

    # ---- following the store ---------------------------------------------------------------------
    def step(self) -> str | None:
        """One poll (blocking: run it off the event loop): ``ScorerFollower.step``."""
        return self.follower.step()

    def _show(self, scorer: Scorer) -> None:
        reset(self.served)
        self.served.labels(self.config.model, scorer.dense_version).set(1)
        reset(self.modes)
        for i, mode in enumerate(scorer.lookup_modes):
            for m in LOOKUP_MODES:
                self.modes.labels(str(i), m).set(int(m == mode))
        for rt in RUNTIMES:
            self.runtime.labels(rt).set(int(rt == scorer.runtime))
        for device in DENSE_DEVICES:
            self.device.labels(device).set(int(device == scorer.choice.device))

    def _show_split(self, split: Split | None) -> None:
        from serving.scoring.experiments import mapped_bytes

        reset(self.arm_mapped)
        for arm, scorer in zip(
            split.experiment.arms if split else [], split.scorers if split else [], strict=True
        ):
            self.arm_mapped.labels(arm.name, arm.version).set(mapped_bytes(scorer))

    def not_serving_reason(self) -> str:
        return self.follower.not_serving_reason()

    async def follow(self) -> None:
        await self.follower.follow()

    # ---- requests -------------------------------------------------------------------------------
    def record(self, scorer: Scorer, reply: Reply) -> Reply:
        """Count a reply ``scorer`` gave and observe its stage times."""
        v = reply.versions
        self.requests.labels(self.config.model, str(reply.status), v.get("dense") or scorer.dense_version,
                             v.get("embedding") or "none").inc()  # fmt: skip
        for stage, ms_ in reply.timings.items():
            self.stages.labels(stage).observe(ms_ / 1e3)
        self._count_arm(reply)
        return reply

    def _count_arm(self, reply: Reply) -> None:
        if arm := arm_of(reply.versions):
            self.arm_requests.labels(arm, str(reply.status)).inc()

    def describe(self, parent: int = 0) -> FrontendRecord:
        """This process for the roster (``recserve versions``); ``parent``: the pid that keeps it."""
        from serving.scoring.roster import FrontendRecord

        scorer, c = self.scorer, self.config
        return FrontendRecord(os.getpid(), parent, f"{c.host}:{c.port}", version=scorer.dense_version if scorer else "",
                              deltas=[f.store.delta_seq for _, f in self.follower.colocated()],
                              lookups=scorer.lookup_modes if scorer else [])  # fmt: skip

    def close(self) -> None:
        self.router.close()  # the shadow arms' queue, scored before the scorers close
        self.follower.close()
        if self.impressions is not None:
            self.impressions.close()


def announce(config: ServeConfig, processes: str) -> None:
    """The start-up line: where the frontend listens, its token auth, lookups and ``processes``."""
    auth = "off (--no-token-auth)" if config.disable_token_auth else f"on, key file {config.key_path()}"
    scheme = "https" if config.https_cert else "http"
    log.info("scoring %s at %s://%s:%d%s%s (token auth %s; lookups %s; %s)", config.model, scheme, config.host,
             config.port, PREDICTIONS, config.model, auth, config.scoring.lookups, processes)  # fmt: skip


def serve(config: ServeConfig) -> int:
    """Run the lean frontend in this process alone (``--workers 1``; N:
    ``serving.scoring.processes.serve_workers``) until SIGTERM (drain, then exit 0) or SIGINT
    (drain, then stop)."""
    announce(config, "one process")
    frontend = Frontend(config)
    return run(frontend, App(frontend))


def run(frontend: Frontend, app: App, sock: socket.socket | None = None, parent: int = 0) -> int:
    """Serve ``app`` until SIGTERM drains it (exit 0; 1 when it never started), listed in the
    roster meanwhile. A worker serves ``sock``, bound by its ``parent``."""
    import uvicorn

    from serving.scoring import roster

    config = frontend.config
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, loop="uvloop", http="httptools", lifespan="on",
        access_log=False, log_level="warning",
        # uvicorn hints int but waits with asyncio (a float timeout is what it gets and honours)
        timeout_graceful_shutdown=max(config.drain_s, 1.0),  # type: ignore[arg-type]
        ssl_certfile=config.https_cert or None, ssl_keyfile=config.https_key or None,
    ))  # fmt: skip
    # uvicorn drains on SIGTERM, then raises the signal again for the handler it found: a no-op
    # here, so a drained stop ends in exit 0 (and this log line) rather than death by the signal
    signal.signal(signal.SIGTERM, lambda *_: None)
    with roster.listed(roster.roster_dir(config.store, config.model), lambda: frontend.describe(parent)):
        server.run(None if sock is None else [sock])
    if not server.started:
        return 1
    log.info("stopped: requests in flight drained")
    return 0
