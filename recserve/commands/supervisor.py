"""``recserve supervisor`` (started by ``recserve up``): restarts any process of the stack that dies
(``serving.stack.supervisor``)."""

from __future__ import annotations

from serving.stack.supervisor import SupervisorConfig as CONFIG


def run(cfg: CONFIG) -> int:
    from serving.stack.supervisor import run_supervisor

    return run_supervisor(cfg)
