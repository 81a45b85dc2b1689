"""``recserve serve``: the lean scoring frontend (flags from ``serving.scoring.lean.ServeConfig``)."""

from __future__ import annotations

from serving.scoring.lean import ServeConfig as CONFIG


def run(cfg: CONFIG) -> int:
    from serving.scoring.lean import serve

    return serve(cfg)
