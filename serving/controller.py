"""``recserve controller``: keeps TorchServe's dense model on the model store's CURRENT version.

Started by ``recserve up`` next to the stack. Every ``--poll-s`` it reads ``<model>/CURRENT``; on a
change it validates the new version (manifest, sha256, ``_SUCCESS``, same feature schema as the
served one), registers it in TorchServe through the management API, makes it the default, lets the
old version drain, then unregisters it. A version that fails validation is reported and skipped;
serving stays on what it has. (The PS shards follow CURRENT and its deltas themselves.)
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time
from pathlib import Path

log = logging.getLogger("recserve.controller")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="the stack's run dir (reads stack.json)")
    p.add_argument("--poll-s", type=float, default=1.0, help="how often to read CURRENT (default 1 s)")
    p.add_argument(
        "--drain-s", type=float, default=2.0, help="time the old dense version keeps serving (default 2 s)"
    )


class Controller:
    def __init__(self, run_dir: Path, drain_s: float = 2.0):
        from serving.stack import LocalStack

        self.stack = LocalStack.attach(run_dir)
        self.drain_s = drain_s
        self.refused: set[str] = set()

    @property
    def served(self) -> str:
        return self.stack.state["dense_version"]

    def step(self) -> str | None:
        """One poll: swap to CURRENT if it changed and validates; returns the new version or None."""
        from serving import model_store
        from serving.model_store import ModelStoreError
        from serving.releases import validate

        cfg = self.stack.config
        target = model_store.current(self.stack.root, cfg.model)
        if not target or target == self.served or target in self.refused:
            return None
        served_manifest = model_store.read_manifest(
            model_store.version_dir(self.stack.root, cfg.model, self.served), verify=False
        )
        try:
            validate(self.stack.root, cfg.model, target, served_manifest.get("schema_fingerprint"))
        except ModelStoreError as e:
            log.error("not swapping to %s: %s", target, e)
            self.refused.add(target)
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


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.nice(10)  # checksums and archiving are background work: serving keeps the CPU
    ctl = Controller(Path(args.run_dir), args.drain_s)
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
