"""``recserve worker``: the embedding worker over gRPC (flags from ``serving.worker.server.WorkerConfig``)."""

from __future__ import annotations

from serving.worker.server import WorkerConfig as CONFIG


def run(cfg: CONFIG) -> int:
    from serving.worker.server import serve

    return serve(cfg)
