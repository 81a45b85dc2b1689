"""Where a scorer reads embedding rows: per shard, mapped in its process (co-located) or through
the worker / the PS shards (remote), as ``ScoringConfig.lookups`` says."""

from __future__ import annotations

import logging

from features.schema import Schema
from model_store.manifest import VersionManifest
from serving.scoring.core import ScoringConfig

log = logging.getLogger("recserve.scoring")


def lookup_backend(
    config: ScoringConfig, schema: Schema, manifest: VersionManifest
) -> tuple[object, list[str]]:
    """The embedding worker this scorer calls (a client of the worker process, or the worker
    library over its shards) and, per shard, "local" or "remote" (``ScoringConfig.lookups``)."""
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
    backends: list = []
    try:
        for i, here in enumerate(local):
            if here:
                backends.append(ColocatedShard(config.version_dir, i, n, dim, config.poll_s))
            else:  # spec is set: each PS call gets the request's deadline
                if spec is None:
                    raise ValueError(f"embedding shard {i} is not on this host and no --ps is given")
                backends.append(connect_shard(spec[i], i, n, timeout_s=config.worker_timeout_s, tls=tls))
        worker = EmbeddingWorker(backends, schema)
    except BaseException:
        for b in backends:
            b.close()
        raise
    return worker, ["local" if here else "remote" for here in local]
