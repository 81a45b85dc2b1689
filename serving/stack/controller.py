"""``recserve controller``: keeps TorchServe's dense model on the model store's CURRENT version.

Started by ``recserve up`` next to the stack. At each notice of a new CURRENT (``--notices``:
``serving.notices``) and every ``--poll-s`` anyway it reads ``<model>/CURRENT`` (a
stack pinned by ``up --version`` keeps its version: ``serving.versions``); on a change it runs the one gate (``model_store.validate``: manifest, checksums, ``_SUCCESS``, same
feature schema and shape as the served dense version), waits until every PS shard serves the new
version's embeddings, then registers the new dense model in TorchServe through the management API,
makes it the default, lets the old version drain, then unregisters it. A version the gate refuses,
or that a shard refuses, is skipped, serving stays on what it has, and the refusal is visible:
under ``refused`` in ``stack.json`` (``recserve versions`` shows it) and counted in
``recserve_version_refusals_total{component="controller"}`` (``--metrics-port``). (The PS shards
follow CURRENT and its deltas themselves.)

No response mixes versions: every scoring process names its dense model's version in its
lookups (version-pinned), a shard keeps the replaced version for lookups that still name it,
and the new dense model becomes the default only once every shard holds the new embeddings.
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
    """How often to read CURRENT anyway (the fallback for a missed notice)."""
    notices: str = "inotify"
    """How a new CURRENT is learnt of at once (serving/notices/): inotify (file events on the
    model's directory), kafka://BROKERS/TOPIC (the model's notice topic), or none (the poll alone)."""
    drain_s: float = 2.0
    """How long the old dense version keeps serving after the switch."""
    shards_timeout_s: float = 900.0
    """How long to wait for every PS shard to serve a new version before giving up on it."""
    metrics_port: int = 0
    """Prometheus /metrics port on 127.0.0.1 (0: off)."""

    def __post_init__(self) -> None:
        if not self.run_dir:
            raise ValueError("--run-dir is required")


class Controller:
    def __init__(self, run_dir: Path, drain_s: float = 2.0, shards_timeout_s: float = 900.0, registry=None):
        from prometheus_client import CollectorRegistry

        from serving.stack.local import LocalStack
        from serving.versions import VersionTarget

        self.stack = LocalStack.attach(run_dir)
        self.drain_s = drain_s
        self.shards_timeout_s = shards_timeout_s
        self.registry = registry or CollectorRegistry()
        state = self.stack.state  # a pinned stack (up --version, not CURRENT) keeps its dense model
        self.versions = VersionTarget(self.stack.root, state.model, "controller", state.pin, self.registry)
        # a client of every PS shard, opened now and kept: gRPC's core (~14 MB) starts with the
        # controller, not at its first switch, and the channels reconnect by themselves
        from serving.ps.client import PSClient
        from serving.stack import tls as stack_tls

        tls = stack_tls.client(state)
        self.shards = [PSClient(a, timeout_s=2.0, tls=tls) for a in state.ps]

    def close(self) -> None:
        for c in self.shards:
            c.close()

    @property
    def served(self) -> str:
        return self.stack.state.dense_version

    def step(self) -> str | None:
        """One poll: swap to CURRENT if it changed and validates; returns the new version or None."""
        import model_store
        from model_store import ModelStoreError
        from model_store.releases import validate

        cfg = self.stack.config
        target = self.versions.target()
        if target is None or not self.versions.wanted(target, self.served):
            return None
        served_manifest = model_store.read_manifest(
            model_store.version_dir(self.stack.root, cfg.model, self.served), verify=False
        )
        try:
            validate(self.stack.root, cfg.model, target, served_manifest)
        except ModelStoreError as e:
            self._refuse(target, str(e))
            return None
        why, final = self.wait_shards(target)
        if why:
            if final:  # a refusal stays one; a timeout is tried again at the next poll
                self._refuse(target, why)
            else:
                log.error("not swapping the dense model to %s yet: %s", target, why)
            return None
        old = self.served
        t0 = time.monotonic()
        self.stack.dense.register(
            model_store.version_dir(self.stack.root, cfg.model, target), target, make_default=True
        )
        self.stack.save_state("dense_version")
        log.info("dense model %s -> %s registered and default in %.2fs", old, target, time.monotonic() - t0)
        time.sleep(self.drain_s)  # requests routed to the old version finish
        try:
            self.stack.dense.retire(old)
        except Exception as e:  # noqa: BLE001 - an old version that lingers is logged, not fatal
            log.warning("unregistering %s failed: %s", old, e)
        from serving import memory

        memory.trim()  # the checksummed files' buffers (serving/memory.py)
        return target

    def _refuse(self, version: str, why: str) -> None:
        """Skip ``version`` from now on, count it, and record why in stack.json for `recserve versions`."""
        self.versions.refuse(version, f"not swapping the dense model to {version}: {why}")
        self.stack.state.refused[version] = why
        self.stack.save_state("refused")

    def wait_shards(self, version: str, poll_s: float = 0.2) -> tuple[str, bool]:
        """Wait until every PS shard serves ``version`` as its newest: ('', _) when they do, else
        (why not, whether that is final: a shard refused it, rather than the wait timing out). A
        shard that is briefly unreachable is waited for."""
        from serving.ps.client import ShardError

        deadline = time.monotonic() + self.shards_timeout_s
        while True:
            waiting = []
            for i, c in enumerate(self.shards):
                try:
                    st = c.stats()
                except ShardError as e:
                    waiting.append(f"shard {i}: {e}")
                    continue
                if st["version"] == version:
                    continue
                if st.get("refusal"):  # a follower's refusal is of the version CURRENT names: this one
                    return f"shard {i} refused it: {st['refusal']}", True
                waiting.append(f"shard {i} serves {st['version'] or 'nothing'}")
            if not waiting:
                return "", True
            if time.monotonic() > deadline:
                why = f"not every shard serves it after {self.shards_timeout_s:g}s: {'; '.join(waiting)}"
                return why, False
            time.sleep(poll_s)


def _preload() -> None:
    """Import what a dense switch uses now, at start (the gate, the archiver, TorchServe's
    clients), so that the first switch adds no step to the controller's memory; gRPC's core, the
    larger step (43 -> 58 MB in a soak), starts with the shards' clients (``Controller.shards``)."""
    import importlib

    for name in ("model_store.releases", "serving.torchserve", "model_archiver.model_packaging",
                 "model_archiver.model_packaging_utils"):  # fmt: skip
        importlib.import_module(name)


def run_controller(args: ControllerConfig) -> int:
    import model_store as ms
    from serving.notices import Wake, open_notices
    from serving.rpc.metrics import start_metrics_server

    os.nice(10)  # checksums and archiving are background work: serving keeps the CPU
    _preload()
    ctl = Controller(Path(args.run_dir), args.drain_s, args.shards_timeout_s)
    start_metrics_server(args.metrics_port, "127.0.0.1", ctl.registry)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(1))
    log.info("following %s/CURRENT (serving dense version %s)", ctl.stack.config.model, ctl.served)
    notices = open_notices(args.notices, ms.model_dir(ctl.stack.root, ctl.stack.config.model), ctl.registry)
    wake = Wake(notices, lambda n: n.delta_seq < 0)  # CURRENT moved
    while not stopping:
        try:
            ctl.step()
        except Exception:  # keep following: the next poll may succeed (TorchServe restarting, ...)
            log.exception("swap step failed")
        wake.wait(args.poll_s)
    if notices is not None:
        notices.close()
    ctl.close()
    return 0
