"""The scoring core's ``lookup`` verb's collaborator: where a scorer reads embedding rows -- per
shard, mapped in its process (co-located) or through the worker / the PS shards (remote), as
``ScoringConfig.lookups`` says -- and the one call that reads them."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from features.schema import Schema
from serving.scoring.errors import LookupFailed

if TYPE_CHECKING:
    from model_store.manifest import VersionManifest
    from serving.notices import Notices
    from serving.scoring.config import ScoringConfig
    from serving.scoring.decoding import Request
    from serving.worker.core import ForwardResult

log = logging.getLogger("recserve.scoring")


class Lookups:
    """The embedding worker of one scorer (a worker process's client, or the worker library over
    its shards in this process) and where each shard's rows are read ("colocated" or "remote")."""

    def __init__(self, worker: Any, modes: list[str], notices: Notices | None = None):
        """``notices``: opened for this scorer's co-located shards, closed with it."""
        from serving.worker.core import EmbeddingWorker

        self.worker = worker
        self.modes = modes
        self.notices = notices
        self._inprocess = isinstance(worker, EmbeddingWorker)  # takes batches, not bytes

    @classmethod
    def of(cls, config: ScoringConfig, schema: Schema, manifest: VersionManifest,
           notices: Notices | None = None) -> Lookups:  # fmt: skip
        """The lookups ``config`` says; co-located shards follow ``notices`` (None: the scorer's own,
        opened when a shard is co-located)."""
        from pathlib import Path

        from serving.notices import open_notices

        own = None
        if notices is None and config.lookups != "remote" and config.notices != "none":
            notices = own = open_notices(config.notices, Path(config.version_dir).parent)
        try:
            worker, modes = lookup_backend(config, schema, manifest, notices)
        except BaseException:
            if own is not None:
                own.close()
            raise
        if own is not None and "colocated" not in modes:  # nothing here follows it
            own.close()
            own = None
        return cls(worker, modes, own)

    @classmethod
    def over(cls, worker: Any) -> Lookups:
        """Lookups through a worker built elsewhere (a test's, a benchmark's)."""
        shards = getattr(worker, "shards", [worker])
        return cls(worker, ["colocated" if getattr(s, "local", False) else "remote" for s in shards])

    def forward(self, request: Request, version: str) -> ForwardResult:
        """The pooled rows of ``request``, read from embedding ``version``; a ``LookupFailed``
        carrying the worker's exception when they cannot be. A worker process is sent the
        client's own bytes when it sent a binary batch (its client encodes any other)."""
        wire = request.wire if request.wire is not None and not self._inprocess else request.batch
        try:
            result: ForwardResult = self.worker.forward(wire, version=version)
        except Exception as e:
            raise LookupFailed(e) from e
        return result

    def close(self) -> None:
        close = getattr(self.worker, "close", None)
        if close:
            close()
        if self.notices is not None:
            self.notices.close()


def lookup_backend(config: ScoringConfig, schema: Schema, manifest: VersionManifest,
                   notices: Notices | None = None) -> tuple[Any, list[str]]:  # fmt: skip
    """The embedding worker this scorer calls (a client of the worker process, or the worker
    library over its shards) and, per shard, "colocated" or "remote" (``ScoringConfig.lookups``)."""
    from serving.rpc.tls import ClientTLS
    from serving.worker.colocated import ColocatedShard, has_local_files
    from serving.worker.replicas import connect_shard, parse_ps_spec

    tls = ClientTLS.of(config.tls_ca, config.tls_cert, config.tls_key)
    spec = parse_ps_spec(config.ps) if config.ps else None
    n = len(spec) if spec else manifest.num_shards
    local = (
        [has_local_files(config.version_dir, i, n) for i in range(n)] if config.lookups != "remote" else []
    )
    if config.lookups == "colocated" and not all(local):
        missing = ", ".join(str(i) for i, here in enumerate(local) if not here)
        raise ValueError(
            f"--lookups colocated: embedding shard(s) {missing} of {n} of {config.version_dir} have no "
            "complete files on this host; serve them remotely (--lookups auto with --ps, or remote)"
        )
    if not any(local) or (not all(local) and spec is None):  # everything through the worker or the PS
        if config.lookups == "auto" and any(local):
            log.warning("lookups auto: shards %s are not on this host and no --ps is given: all remote",
                        [i for i, here in enumerate(local) if not here])  # fmt: skip
        if spec is None:
            from serving.worker.client import connect_workers

            return connect_workers(config.worker, timeout_s=config.worker_timeout_s, tls=tls), ["remote"] * n
        local = [False] * n
    from serving.worker.core import EmbeddingWorker

    dim = manifest.dim
    backends: list[Any] = []
    try:
        for i, here in enumerate(local):
            if here:
                backends.append(ColocatedShard(config.version_dir, i, n, dim, config.poll_s, notices=notices))
            else:  # spec is set: each PS call gets the request's deadline
                if spec is None:
                    raise ValueError(f"embedding shard {i} is not on this host and no --ps is given")
                backends.append(connect_shard(spec[i], i, n, timeout_s=config.worker_timeout_s, tls=tls))
        worker = EmbeddingWorker(backends, schema)
    except BaseException:
        for b in backends:
            b.close()
        raise
    return worker, ["colocated" if here else "remote" for here in local]
