"""What a scoring process serves and its limits: ``ScoringConfig``, read by the scorer
(``serving.scoring.core``), its lookups (``serving.scoring.lookups``) and both frontends (the
lean one's ``ServeConfig.scoring``, the TorchServe handler's ``scoring.json``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from model_store.dense import AUTO, CHOICES
from model_store.devices import CPU, DEVICES, check_device

LOOKUPS = ("remote", "colocated", "auto")


@dataclass
class ScoringConfig:
    """What a scoring process serves and its limits."""

    version_dir: str = field(default="", metadata={"cli": False})
    """model_store/<model>/<version>: schema.yaml, dense model, MANIFEST.json (a frontend that
    follows the store sets it to the version it loads)."""
    lookups: str = field(default="auto", metadata={"choices": ["auto", "colocated", "remote"]})
    """Where embedding rows are read: auto (per shard, mapped in this process where the version's
    files are on this host, through --ps elsewhere; through --worker when no shard is here, or when
    some are missing and --ps is not given), colocated (every shard mapped here: its files must be
    on this host) or remote (through --worker, or the PS shards of --ps)."""
    worker: str = "127.0.0.1:50060"
    """Embedding worker address (HOST:PORT) for remote lookups; several workers joined by | (a:1|b:1):
    each lookup goes to one of them and fails over to the next within its deadline."""
    ps: list[str] | None = None
    """PS shard addresses, shard i at entry i, a shard's replicas joined by | (a:1|a:2,b:1): the
    worker then runs as a library in this process over them (one process hop fewer than --worker)."""
    notices: str = "inotify"
    """How new deltas (co-located shards) and versions are learnt of at once (serving/notices/):
    inotify (file events on the model's directory, one host), kafka://BROKERS/TOPIC (the model's
    notice topic), or none (the poll alone)."""
    poll_s: float = 5.0
    """How often to look for new deltas of the served version (co-located shards) and new versions
    anyway (the fallback for a missed notice)."""
    runtime: str = field(default=AUTO, metadata={"choices": CHOICES})
    """Dense runtime: auto serves, on the cpu, the one the version's export measured faster (its
    manifest's dense_runtime; torchscript for versions exported before that), and where --device
    takes a GPU the fastest timed on this host at load."""
    device: str = field(default=CPU, metadata={"choices": list(DEVICES)})
    """Where the dense model runs: cpu, cuda (refused where torch sees no CUDA device) or auto
    (cuda where there is one, else cpu; the runtime timed on this host). docs/serving.md."""
    max_items: int = 1000
    """Items per scoring request (more: 413)."""
    max_body_bytes: int = 4 << 20
    """Request body limit in bytes (more: 413)."""
    worker_timeout_s: float = 1.0
    """Deadline of the embedding lookups of one request (worker call or PS calls)."""
    threads: int = 1
    """Intra-op threads of the dense runtime."""
    verify: bool = True
    """Check the checksums of the files the scorer reads (dense model, schema)."""
    log_impressions: str = ""
    """Log every scored request (request id, versions, the compact batch as scored, scores) to
    Kafka: kafka://BROKERS/TOPIC; off the request path, dropped and counted when Kafka is slow or
    down ('' = off)."""
    tls_ca: str = ""
    """TLS to the worker or PS shards: the CA that signed their certificates (PEM; empty: plaintext)."""
    tls_cert: str = ""
    """mTLS: this process's client certificate (PEM)."""
    tls_key: str = ""
    """mTLS: this process's client key (PEM)."""

    def __post_init__(self) -> None:
        if self.ps == []:
            self.ps = None
        check_device(self.device, self.runtime)  # --device cuda without CUDA: refused at start
        if self.lookups not in LOOKUPS:
            raise ValueError(f"unknown lookups {self.lookups!r}; choose one of {', '.join(LOOKUPS)}")
        from serving.worker.client import parse_workers

        parse_workers(self.worker)  # a malformed --worker is refused at start, not at the first version
        from serving.notices import parse

        parse(self.notices)
        if self.log_impressions:
            from serving.scoring.impressions import Target

            Target.parse(self.log_impressions)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ScoringConfig:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown scoring config keys: {sorted(unknown)}")
        return cls(**d)
