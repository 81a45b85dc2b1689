"""The trainer's Prometheus metrics (``recserve train --metrics-port``), one set per rank:
``recserve_train_samples_total``, ``recserve_train_steps_total``, ``recserve_train_loss``,
``recserve_train_epoch``, ``recserve_train_checkpoint_step`` (the newest checkpoint written),
``recserve_train_checkpoint_seconds`` and ``recserve_train_auc`` (rank 0's last evaluation), each
labelled with the rank. Samples/s is ``rate(recserve_train_samples_total[1m])``."""

from __future__ import annotations

import os

from serving.rpc.metrics import start_metrics_server


class TrainMetrics:
    """A rank's metrics, served from the start; ``close`` stops the server."""

    def __init__(self, port: int, host: str, rank: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        reg, r = self.registry, str(rank)
        self.samples = Counter(
            "recserve_train_samples", "Training rows this rank trained on.", ["rank"], registry=reg
        ).labels(r)
        self.steps = Counter(
            "recserve_train_steps", "Training steps this rank took.", ["rank"], registry=reg
        ).labels(r)
        self.loss = Gauge(
            "recserve_train_loss", "The last step's training loss.", ["rank"], registry=reg
        ).labels(r)
        self.epoch = Gauge(
            "recserve_train_epoch", "The epoch being trained (1-based).", ["rank"], registry=reg
        ).labels(r)
        self.checkpoint_step = Gauge(
            "recserve_train_checkpoint_step",
            "The step of the newest checkpoint written.",
            ["rank"],
            registry=reg,
        ).labels(r)
        self.checkpoint_seconds = Histogram(
            "recserve_train_checkpoint_seconds", "Time to write a checkpoint.", ["rank"], registry=reg,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
        ).labels(r)  # fmt: skip
        self.auc = Gauge(
            "recserve_train_auc", "Test AUC of the last evaluation (rank 0).", ["rank"], registry=reg
        ).labels(r)
        # several ranks on one node: one port each
        self._stop = start_metrics_server(port + int(os.environ.get("LOCAL_RANK", "0")) if port else 0,
                                          host, self.registry)  # fmt: skip

    def close(self) -> None:
        self._stop()
