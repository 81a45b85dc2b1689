"""``recserve controller``: keeps TorchServe's dense model on the model store's CURRENT version.

Started by ``recserve up`` next to the stack. Every ``--poll-s`` it reads ``<model>/CURRENT``; on a
change it runs the one gate (``model_store.validate``: manifest, sha256, ``_SUCCESS``, same
feature schema and shape as the served dense version), registers it in TorchServe through the
management API, makes it the default, lets the old version drain, then unregisters it. A version
the gate refuses is skipped, serving stays on what it has, and the refusal is visible: under
``refused`` in ``stack.json`` (``recserve versions`` shows it) and counted in
``recserve_version_refusals_total{component="controller"}`` (``--metrics-port``). (The PS shards
follow CURRENT and its deltas themselves.)
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("recserve.controller")


@dataclass
class ControllerConfig:
    """The controller beside a running stack."""

    run_dir: str = field(default="", metadata={"help": "the stack's run dir (reads stack.json)"})
    """The stack's run dir (reads stack.json)."""
    poll_s: float = 1.0
    """How often to read CURRENT."""
    drain_s: float = 2.0
    """How long the old dense version keeps serving after the switch."""
    metrics_port: int = 0
    """Prometheus /metrics port on 127.0.0.1 (0: off)."""

    def __post_init__(self) -> None:
        if not self.run_dir:
            raise ValueError("--run-dir is required")


class Controller:
    def __init__(self, run_dir: Path, drain_s: float = 2.0, registry=None):
        from prometheus_client import CollectorRegistry

        from serving.rpc.metrics import version_refusals
        from serving.stack.local import LocalStack

        self.stack = LocalStack.attach(run_dir)
        self.drain_s = drain_s
        self.refused: set[str] = set()
        self.registry = registry or CollectorRegistry()
        self.refusals = version_refusals(self.registry)

    @property
    def served(self) -> str:
        return self.stack.state["dense_version"]

    def step(self) -> str | None:
        """One poll: swap to CURRENT if it changed and validates; returns the new version or None."""
        import model_store
        from model_store import ModelStoreError
        from model_store.releases import validate

        cfg = self.stack.config
        target = model_store.current(self.stack.root, cfg.model)
        if not target or target == self.served or target in self.refused:
            return None
        served_manifest = model_store.read_manifest(
            model_store.version_dir(self.stack.root, cfg.model, self.served), verify=False
        )
        try:
            validate(self.stack.root, cfg.model, target, served_manifest)
        except ModelStoreError as e:
            log.error("not swapping to %s: %s", target, e)
            self.refused.add(target)
            self.refusals.labels("controller", "version").inc()
            self.stack.state.setdefault("refused", {})[target] = str(e)  # `recserve versions` shows it
            self.stack.save_state()
            return None
        old = self.served
        t0 = time.monotonic()
        self.stack.register(
            model_store.version_dir(self.stack.root, cfg.model, target), target, make_default=True
        )
        self.stack.save_state()
        log.info("dense model %s -> %s registered and default in %.2fs", old, target, time.monotonic() - t0)
        time.sleep(self.drain_s)  # requests routed to the old version finish
        try:
            self.stack.management().unregister(cfg.model, old, synchronous=False)  # see LocalStack.register
        except Exception as e:  # noqa: BLE001 - an old version that lingers is logged, not fatal
            log.warning("unregistering %s failed: %s", old, e)
        return target


def run_controller(args: ControllerConfig) -> int:
    from serving.rpc.metrics import start_metrics_server

    os.nice(10)  # checksums and archiving are background work: serving keeps the CPU
    ctl = Controller(Path(args.run_dir), args.drain_s)
    start_metrics_server(args.metrics_port, "127.0.0.1", ctl.registry)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    log.info("following %s/CURRENT (serving dense version %s)", ctl.stack.config.model, ctl.served)
    while not stopping:
        try:
            ctl.step()
        except Exception:  # keep following: the next poll may succeed (TorchServe restarting, ...)
            log.exception("swap step failed")
        time.sleep(args.poll_s)
    return 0
