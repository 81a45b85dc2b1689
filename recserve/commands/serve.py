"""``recserve serve``: the lean scoring frontend (flags from ``serving.scoring.lean.ServeConfig``):
one process (``--workers 1``), or a parent keeping N on one port (``serving.scoring.processes``)."""

from __future__ import annotations

from serving.scoring.lean import ServeConfig as CONFIG


def run(cfg: CONFIG) -> int:
    n = cfg.worker_count()
    if n > 1:
        from serving.scoring.processes import serve_workers

        return serve_workers(cfg, n)
    from serving.scoring.lean import serve

    return serve(cfg)
