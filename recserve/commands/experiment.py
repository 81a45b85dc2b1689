"""``recserve experiment start | status | stop | promote | abort | watch``: a model's experiment in
the store (``model_store.experiments``: the record, its history, the one publish through the gate).

``start --name N --candidate VERSION --share 0.1 [--candidate V2 --share 0.1] [--shadow V3]
[--unit-key user_id]``: control is CURRENT with the share the candidates leave (arms A, B, ... in
the order given, shadows after them). ``promote ARM`` publishes the arm's version and ends the
experiment; ``abort ARM`` gives its units back to control (the experiment ends with its last
candidate); ``stop`` ends it with no decision. Every refusal exits 1 naming the problem.

``watch --brokers B [--auto] [--metrics-port P]`` is the experiment's metrics role (``stream.watch``):
it reads the samples topic from the experiment's start, shows every arm's figures and the rule's
verdicts on /metrics and in ``status``, and with ``--auto`` promotes or aborts by the rule."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from recserve import config
from recserve.config import store_field
from stream.watch.config import WatchConfig

if TYPE_CHECKING:
    from model_store.experiments import Experiment

log = logging.getLogger("recserve.experiment")

ACTIONS = ("start", "status", "stop", "promote", "abort", "watch")
REPEATED = ("candidate", "share", "shadow")
"""Flags given once per arm (``action="append"``): the config's generated list flags read A,B."""


@dataclass
class ExperimentConfig:
    """``recserve experiment``."""

    action: str = field(
        default="", metadata={"positional": True, "choices": ACTIONS, "help": " | ".join(ACTIONS)}
    )
    """What to do."""
    arm: str = field(default="", metadata={"positional": True, "help": "the arm to promote or abort"})
    """The arm to promote or abort (A, B, ...: `status` names them)."""
    store: str = store_field()
    """Model-store root."""
    model: str = "criteo"
    """Model name in the store."""
    name: str = ""
    """start: the experiment's name."""
    candidate: list[str] = field(default_factory=list, metadata={"metavar": "VERSION"})
    """start: a candidate arm's version (once per candidate, each followed by its --share)."""
    share: list[float] = field(default_factory=list, metadata={"metavar": "FRACTION"})
    """start: the fraction of units the candidate before it serves (0.1: 10%)."""
    shadow: list[str] = field(default_factory=list, metadata={"metavar": "VERSION"})
    """start: a shadow arm's version: scored off the response path, serves no unit (once per arm)."""
    unit_key: str = ""
    """start: the request field that names a unit (e.g. user_id; '': the request id)."""
    salt: str = ""
    """start: hashed with each unit key ('': derived from the name and the start time)."""
    json: bool = False
    """status: print the record as JSON."""
    watch: WatchConfig = field(default_factory=WatchConfig)
    """watch: the metrics role's flags (--brokers, --samples, --window-s, --every-s, --auto, ...)."""

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"give an ACTION: {', '.join(ACTIONS)}")
        if (self.action in ("promote", "abort")) != bool(self.arm):
            raise ValueError(f"`{self.action}` takes {'an ARM' if not self.arm else 'no ARM'}")
        starting = (self.name, self.candidate, self.share, self.shadow, self.unit_key, self.salt)
        if self.action != "start" and any(starting):
            raise ValueError("--name, --candidate, --share, --shadow, --unit-key and --salt are for `start`")
        if self.action != "watch" and self.watch != WatchConfig():
            raise ValueError("--brokers, --samples, --group, --kafka-config, --window-s, --every-s, "
                             "--metrics-port, --host, --auto and --rule are for `watch`")  # fmt: skip
        if self.action == "start" and not self.name:
            raise ValueError("`start` needs --name")
        if len(self.candidate) != len(self.share):
            raise ValueError(f"{len(self.candidate)} --candidate but {len(self.share)} --share: one each")


CONFIG = ExperimentConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The config's flags, with --candidate, --share and --shadow given once per arm."""
    config.add_arguments(p, ExperimentConfig, skip=REPEATED)
    docs = {name: doc.replace("%", "%%") for name, doc in config.field_docs(ExperimentConfig).items()}
    p.add_argument("--candidate", action="append", metavar="VERSION", help=docs["candidate"])
    p.add_argument("--share", action="append", type=float, metavar="FRACTION", help=docs["share"])
    p.add_argument("--shadow", action="append", metavar="VERSION", help=docs["shadow"])


def run(cfg: ExperimentConfig) -> int:
    from model_store import ModelStoreError
    from model_store import experiments as ex

    if cfg.action == "watch":
        return _watch(cfg)
    try:
        if cfg.action == "status":
            return _status(cfg, ex.read_experiment(cfg.store, cfg.model))
        exp = CHANGES[cfg.action](cfg)
    except ModelStoreError as e:
        print(f"refused: {e}", file=sys.stderr)
        return 1
    print(f"{cfg.model}: experiment {describe(exp)}")
    for d in exp.decisions[-1:] if cfg.action in ("promote", "abort") else ():
        print(f"{cfg.model}: arm {d.arm} (version {d.version}) {d.decision}" +
              (f", CURRENT -> {d.version}" if d.decision == ex.PROMOTED else ", its units back to control"))  # fmt: skip
    return 0


def _watch(cfg: ExperimentConfig) -> int:
    """The metrics role until SIGTERM/SIGINT: 2 when it cannot start (no samples topic, Kafka or the
    /metrics port unreachable, a bad --rule file), 1 when reading fails later."""
    import yaml
    from confluent_kafka import KafkaException
    from prometheus_client import CollectorRegistry

    from serving.rpc.metrics import start_metrics_server
    from stream.sequential import SequentialConfig
    from stream.watch import Watcher, WatchError

    w = cfg.watch
    try:
        rule = config.load_yaml(SequentialConfig, w.rule) if w.rule else SequentialConfig()
        registry = CollectorRegistry()
        watcher = Watcher(cfg.store, cfg.model, w, rule, registry)
        partitions = watcher.check_topic()
        stop_metrics = start_metrics_server(w.metrics_port, w.host, registry)
    except (
        OSError,
        ValueError,
        yaml.YAMLError,
        KafkaException,
        WatchError,
    ) as e:  # MetricsPortError: an OSError
        print(f"recserve experiment watch: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("experiment watch: %s (%d partitions) for %s in %s, window %gs, every %gs, rule %s, %s",
             w.samples, partitions, cfg.model, cfg.store, w.window_s, w.every_s, rule,
             "--auto: the rule promotes and aborts" if w.auto else "verdicts shown only (no --auto)")  # fmt: skip
    try:
        watcher.run(stop)
    except WatchError as e:
        print(f"recserve experiment watch: {e}", file=sys.stderr)
        return 1
    finally:
        stop_metrics()
    return 0


def _start(cfg: ExperimentConfig) -> Experiment:
    from model_store import experiments as ex

    candidates = list(zip(cfg.candidate, cfg.share, strict=True))
    return ex.start(cfg.store, cfg.model, cfg.name, candidates, cfg.shadow, cfg.unit_key, cfg.salt)


def _stop(cfg: ExperimentConfig) -> Experiment:
    from model_store import experiments as ex

    return ex.stop(cfg.store, cfg.model)


def _promote(cfg: ExperimentConfig) -> Experiment:
    from model_store import experiments as ex

    return ex.promote(cfg.store, cfg.model, cfg.arm)


def _abort(cfg: ExperimentConfig) -> Experiment:
    from model_store import experiments as ex

    return ex.abort(cfg.store, cfg.model, cfg.arm)


CHANGES = {"start": _start, "stop": _stop, "promote": _promote, "abort": _abort}
"""Each action but ``status``: it changes the record and returns what it wrote."""


def _status(cfg: ExperimentConfig, exp: Experiment | None) -> int:
    if cfg.json:
        print(json.dumps(None if exp is None else asdict(exp), indent=1, sort_keys=True))
        return 0
    if exp is None:
        print(f"no experiment for {cfg.model} in {cfg.store}")
        return 0
    ended = f", ended {_when(exp.ended)}" if exp.ended is not None else ""
    print(f"experiment {exp.name} ({cfg.model}): {exp.state} since {_when(exp.started)}{ended}")
    print(f"  unit key {exp.unit_key or '(the request id)'}, salt {exp.salt}")
    for a in exp.arms:
        print(f"  {a.name:<8} version {a.version:<6} " + ("shadow" if a.shadow else f"share {a.share:.1%}"))
    for d in exp.decisions:
        evidence = f" {json.dumps(d.evidence, sort_keys=True)}" if d.evidence else ""
        print(f"  {_when(d.at)}  {d.arm} (version {d.version}) {d.decision} by {d.by}{evidence}")
    _figures(cfg, exp)
    return 0


def _figures(cfg: ExperimentConfig, exp: Experiment) -> None:
    """The latest look of ``recserve experiment watch`` at this experiment, when it wrote one."""
    from stream.watch import ReportError, read_report

    try:
        report = read_report(cfg.store, cfg.model)
    except ReportError as e:
        print(f"  figures: unreadable ({e})")
        return
    if report is None or report.experiment != exp.name:
        return
    auto = "acted on" if report.auto else "not acted on (no --auto)"
    print(f"  figures at {_when(report.at)} (recserve experiment watch; verdicts {auto}):")
    print(f"  {'arm':<8} {'samples':>8} {'clicks':>7} {'ctr':>7} {'mean pred':>9} {'calib':>6} {'logloss':>8} {'auc':>6}"
          f"   (window {report.window_s:g}s: samples, logloss)")  # fmt: skip
    for a in report.arms:
        m, w = a.cumulative, a.window
        print(f"  {a.arm:<8} {m.samples:>8} {m.clicks:>7} {m.ctr.value:>7.4f} {m.mean_predicted.value:>9.4f} "
              f"{m.calibration.value:>6.3f} {m.logloss.value:>8.5f} {m.auc.value:>6.4f}   ({w.samples}, {w.logloss.value:.5f})")  # fmt: skip
    for r in report.rule:
        ev = r.typed()
        print(f"  rule: {r.arm} {r.verdict}: {'; '.join(ev.reasons)} (statistic {ev.statistic:.3f} of "
              f"{ev.threshold:.3f}, n {ev.n_candidate}/{ev.n_control})")  # fmt: skip


def describe(exp: Experiment) -> str:
    """One line: the experiment, its state and its arms."""
    arms = ", ".join(
        f"{a.name} v{a.version} " + ("shadow" if a.shadow else f"{a.share:.1%}") for a in exp.arms
    )
    return f"{exp.name} {exp.state} since {_when(exp.started)}: {arms} (unit: {exp.unit_key or 'request id'})"


def running_line(store: str, model: str) -> str:
    """``recserve versions``' line for the model's running experiment ('' : none runs)."""
    from model_store import experiments as ex

    try:
        exp = ex.read_experiment(store, model)
    except ex.ExperimentError as e:
        return f"experiment: unreadable ({e})"
    return f"experiment {describe(exp)}" if exp is not None and exp.running else ""


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"
