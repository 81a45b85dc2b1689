"""``recserve ps``: one embedding PS shard over gRPC (flags from ``serving.ps.config.ServerConfig``
with its ``store``, the store's ``table`` spec and its ``optimizer`` flattened: --shard, --dim,
--optimizer, --lr, --l1, ...)."""

from __future__ import annotations

from serving.ps.config import ServerConfig as CONFIG


def run(cfg: CONFIG) -> int:
    import uvloop

    from serving.ps.server import serve

    uvloop.run(serve(cfg))
    return 0
