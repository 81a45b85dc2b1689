"""``recserve experiment watch``'s settings (flags generated from them by ``recserve.config``,
flattened into ``recserve experiment``'s config)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WatchConfig:
    """The experiment's metrics role: the samples it reads, how it reports, whether it acts."""

    brokers: str = "127.0.0.1:9092"
    """watch: Kafka bootstrap servers, host:port,host:port."""
    samples: str = "samples"
    """watch: the topic of joined samples (what ``recserve join`` writes)."""
    group: str = "recserve-experiment"
    """watch: consumer group id (nothing is committed: a restart reads again from the experiment's start)."""
    kafka_config: str = ""
    """watch: file of librdkafka settings, KEY=VALUE a line (security.protocol, sasl.*, ssl.*, ...)."""
    window_s: float = 300.0
    """watch: the sliding window of the windowed figures (seconds of event time)."""
    every_s: float = 5.0
    """watch: how often the figures are recomputed and the rule evaluated (seconds)."""
    metrics_port: int = 0
    """watch: Prometheus /metrics HTTP port (0: off)."""
    host: str = "127.0.0.1"
    """watch: interface the /metrics port binds."""
    auto: bool = False
    """watch: act on the rule: promote a winning candidate (through the gate) and abort a losing or
    guardrail-breaking one, recorded with its evidence (off: the verdicts are only shown)."""
    rule: str = ""
    """watch: YAML file of the rule's settings (stream.sequential.SequentialConfig: metric, alpha,
    tau, min_samples, calibration_band, min_clicks); '': its defaults."""

    def __post_init__(self) -> None:
        if not self.window_s > 0 or not self.every_s > 0:
            raise ValueError(f"--window-s and --every-s must be > 0, got {self.window_s} and {self.every_s}")
        if not self.samples:
            raise ValueError("--samples must name a topic")
