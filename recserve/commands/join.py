"""``recserve join``: join impressions and events into labelled samples (flags from
``stream.config.JoinConfig``; see docs/streaming.md)."""

from __future__ import annotations

import logging
import signal
import sys
import threading

from stream.config import JoinConfig as CONFIG

log = logging.getLogger("recserve.join")


def run(cfg: CONFIG) -> int:
    from prometheus_client import CollectorRegistry

    from serving import memory
    from serving.rpc.metrics import start_metrics_server
    from stream.joiner import Joiner, JoinError

    if cfg.replay_quarantine:
        return _replay(cfg)
    registry = CollectorRegistry()
    joiner = Joiner(cfg, registry, read_to_end=_give_back)
    try:
        partitions = joiner.check_topics()
    except JoinError as e:
        print(f"recserve join: {e}", file=sys.stderr)
        return 2
    stop_metrics = start_metrics_server(cfg.metrics_port, cfg.host, registry)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("join: %s + %s -> %s (%d partitions, label after %gs, attribution %gs, group %s%s)", cfg.impressions,
             cfg.events, cfg.samples, partitions, cfg.label_after_s, cfg.attribution_s or cfg.label_after_s, cfg.group,
             f", member {cfg.member}" if cfg.member else "")  # fmt: skip
    memory.freeze_loaded()  # its imports, out of the collector's scans (serving/memory.py)
    try:
        with memory.trimming():  # a catch-up's buffers, freed, back to the system (serving/memory.py)
            joiner.run(stop)
    except JoinError as e:
        log.error("join: %s (stopping without committing: a restart re-reads it)", e)
        return 1
    finally:
        stop_metrics()
    log.info("join: stopped: %s", joiner.counts)
    return 0


def _give_back() -> None:
    """The joiner read every input to its end after an assignment (a restart's backlog): the
    allocator's free pages back to the system (``stream.joiner.Joiner._read_to_end``)."""
    from serving import memory

    before = memory.rss_mb()
    memory.trim()
    log.info("join: read every input to its end; RSS %.0f -> %.0f MB", before, memory.rss_mb())


def _replay(cfg: CONFIG) -> int:
    from stream.quarantine import ReplayError, replay

    try:
        done = replay(cfg)
    except ReplayError as e:
        print(f"recserve join --replay-quarantine: {e}", file=sys.stderr)
        return 1
    print(f"replayed {done.samples} quarantined samples from {cfg.quarantine_topic()} to {cfg.samples}")
    return 0
