"""``StackConfig``: what ``recserve up`` serves and where (recorded whole in stack.json)."""

from __future__ import annotations

from dataclasses import dataclass, field

import model_store
from model_store.dense import AUTO, CHOICES
from model_store.devices import DEVICES, check_device
from serving.ps.spec import DTYPES


@dataclass
class StackConfig:
    """What to serve and where (``recserve up``)."""

    store: str = field(default_factory=model_store.default_root)
    """Model-store root ($RECSERVE_STORE or ./artifacts)."""
    model: str = "criteo"
    """Model name in the store (and the TorchServe model name)."""
    version: str | None = None
    """Version to serve (None: the one CURRENT names, followed as it changes)."""
    run_dir: str | None = None
    """Pid files, logs and configs (None: <store>/.run/<model>)."""
    host: str = "127.0.0.1"
    """Interface every listener binds (loopback unless told otherwise)."""
    http_port: int = 8080
    """TorchServe inference port (0: any free port)."""
    management_port: int = 8081
    """TorchServe management port, loopback only (0: any free port)."""
    metrics_port: int = 8082
    """TorchServe metrics port (0: any free port)."""
    worker_port: int = 0
    """Embedding worker gRPC port (0: any free port)."""
    ps_shards: int = 0
    """PS processes (0: as many as the version was trained with; else re-sharded on load)."""
    ps_ports: list[int] = field(default_factory=list)
    """One gRPC port per PS process, shard by shard (shard 0's replicas first; empty: free ports)."""
    replicas: int = 1
    """PS processes per shard, each following the store on its own: the worker spreads a shard's
    lookups over its SERVING replicas and retries another when one fails."""
    supervise: bool = True
    """Start the supervisor: a process of the stack that dies is restarted (with backoff)."""
    dtype: str = field(default="float32", metadata={"choices": list(DTYPES)})
    """Row storage of the PS shards: float32 maps the version's rows as they are; float16 halves
    row memory (an fp32 version's rows converted into memory at load)."""
    runtime: str = field(default=AUTO, metadata={"choices": CHOICES})
    """Dense runtime in the handler (auto: the one the version's export measured faster)."""
    device: str = field(default="cpu", metadata={"choices": list(DEVICES)})
    """Where the handler runs the dense model: cpu, cuda or auto (docs/serving.md)."""
    disable_token_auth: bool = field(default=False, metadata={"flag": "no-token-auth"})
    """Turn TorchServe token auth OFF (it is on by default; `up` says which)."""
    torchserve: bool = True
    """Start TorchServe with the scoring handler and the controller that keeps its dense model on
    CURRENT; --no-torchserve starts the PS shards and the embedding worker alone, for `recserve serve
    --lookups remote --worker <the worker>` in front, as the Kubernetes manifests run them."""
    ts_workers: int = 1
    """TorchServe handler processes."""
    batch_size: int = 1
    """TorchServe batching (requests per handler call)."""
    max_batch_delay_ms: int = 1
    """How long TorchServe waits to fill a batch."""
    worker_timeout_s: float = 1.0
    """Deadline of the handler's worker call."""
    max_items: int = 1000
    """Items per scoring request."""
    worker_in_handler: bool = False
    """Run the embedding worker as a library inside the handler over the PS shards (one process
    hop and one 330 KB pooled reply fewer per request); the worker process still serves others."""
    lookups: str = field(default="auto", metadata={"choices": ["auto", "colocated", "remote"]})
    """Where the handler reads rows (ScoringConfig.lookups): auto maps every shard whose files are on
    this host, as they are where `up` runs, and reads any other from the stack's PS shards;
    colocated insists on mapping all; remote reads all through the worker process."""
    startup_timeout_s: float = 180.0
    """How long `up` waits for every part to be healthy (every PS shard serving the version)."""
    poll_s: float = 1.0
    """How often the PS shards and the controller look for new versions/deltas."""
    log_impressions: str = ""
    """Log every request the handler scores to Kafka, kafka://BROKERS/TOPIC (ScoringConfig's
    log_impressions: off the request path, dropped and counted when Kafka is slow or down)."""
    tls: bool = False
    """Make a local CA and certificates under <run_dir>/tls; the PS shards and the worker serve TLS."""
    tls_client_auth: bool = True
    """With --tls: mTLS, the PS shards and the worker accept only the stack's client certificate."""

    def __post_init__(self) -> None:
        check_device(self.device, self.runtime)  # --device cuda without CUDA: refused before anything starts
        if self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, not {self.replicas}")
