"""``recserve worker``: the embedding worker over gRPC (flags from ``serving.worker.server.WorkerServerConfig``)."""

from __future__ import annotations

from serving.worker.server import WorkerServerConfig as CONFIG


def run(cfg: CONFIG) -> int:
    from serving.worker.server import serve

    return serve(cfg)
