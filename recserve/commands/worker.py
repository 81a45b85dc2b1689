"""``recserve worker``: the embedding worker over gRPC (flags from ``serving.worker.server.ServerConfig``)."""

from __future__ import annotations

from serving.worker.server import ServerConfig as CONFIG


def run(cfg: CONFIG) -> int:
    from serving.worker.server import serve

    return serve(cfg)
