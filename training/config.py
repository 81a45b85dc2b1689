"""The trainer's configuration: typed dataclasses (flags and YAML via ``recserve.config``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace

from model_store.layout import default_root
from serving.ps import optim
from serving.ps.config import TableShardConfig
from serving.ps.spec import TableSpec
from training.planning.plan import SHARDINGS

DEVICES = ("auto", "cpu", "cuda")
"""Where the dense network can train (``--device``; ``training.ranks.choose_device``)."""
ARCHS = ("lr", "fm", "deepfm", "dlrm")
"""Dense network architectures (``--arch``; ``training.models.ModelConfig.kind``)."""
EMBEDDINGS = ("ps", "inprocess")
"""Where the embedding rows live while training (``--embeddings``)."""


def train_table(**changes) -> TableSpec:
    """The trainer's default table spec (``TableSpec``'s, with a sparse learning rate of 0.005),
    with ``changes``."""
    return replace(TableSpec(optimizer=optim.OptimizerSpec(lr=0.005)), **changes)


@dataclass
class TrainConfig:
    """Everything `recserve train` needs; the defaults train DLRM on the bundled Criteo split."""

    # ---- data
    schema: str = "data/schemas/criteo.yaml"
    """Feature schema YAML."""
    data: str = "data/criteo/wide_resdnn_criteo_train.tsv"
    """Training data: a file, a directory or a glob (TSV/CSV with or without a header, Parquet,
    gzip), or a bounded data source <kind>://... (training/sources/), streamed every epoch."""
    test: str = "data/criteo/wide_resdnn_criteo_test.tsv"
    """Test data (the same forms): AUC/logloss, ONNX verification and the exported eval scores."""
    data_format: str = "auto"
    """Format of the data and test files: auto (per file, from its suffix, then its content), tsv,
    csv or parquet; tsv and csv may add :header or :noheader (default: detected). A headerless
    file's columns are the schema's label, then each slot's column."""
    block_size: int = 4 << 20
    """Bytes of text read and converted per chunk."""
    shuffle_buffer: int = 65536
    """Rows mixed at a time by the shuffle buffer (<= 1: file order); ~1 KB each for Criteo."""
    limit: int | None = None
    """Read at most this many training rows (None: all)."""
    dense_stats: bool = True
    """Standardise dense features with the mean/std fitted on the training split (after the
    schema's own transform): applied by the dense network, recorded in the manifest's model_config;
    the schema stays as written."""

    # ---- model
    arch: str = field(default="dlrm", metadata={"choices": list(ARCHS)})
    """Network architecture: lr, fm, deepfm or dlrm (training.models)."""
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 16])
    """DLRM bottom MLP widths (the last must equal dim)."""
    top_mlp: list[int] = field(default_factory=lambda: [64, 32])
    """Top (DLRM) / deep (DeepFM) MLP hidden widths."""
    dropout: float = 0.0
    """Dropout in the top/deep MLP."""

    # ---- optimisation
    epochs: int = 2
    """Passes over the training data (the 8k Criteo split overfits from the third on)."""
    batch_size: int = 128
    """Rows per step on each rank."""
    table: TableSpec = field(default_factory=train_table)
    """The embedding tables' spec (--dim, --capacity, --eviction, ..., --optimizer and every
    hyper-parameter of it: --lr, --l1, --beta1, ...), the same for every shard we start and
    written into every dump. Its learning rate here is 0.005: Adagrad 0.05 overfits 8k rows in one
    epoch (test AUC peaks at ~0.70 then falls; 0.005 peaks at ~0.72 in epoch 2). With --embeddings
    inprocess, an optimizer with a torch counterpart."""
    dense_lr: float = 1e-3
    """Adam learning rate of the dense network."""
    seed: int = 0
    """Seeds the dense init, the row shuffle and the PS row init."""

    # ---- embeddings: the sharding plan, PS and worker
    embeddings: str = field(default="ps", metadata={"choices": list(EMBEDDINGS)})
    """ps: every table exported as PS shards, trained where the sharding plan puts it;
    inprocess: torch EmbeddingBag tables in the trainer (a baseline for benchmarks; nothing
    servable is exported)."""
    sharding: str = field(default="auto", metadata={"choices": list(SHARDINGS)})
    """Where each embedding table trains (training/planning/plan.py): auto (training/planning/planner.py, from a sample of
    the data and --memory-gb), ps (every table on the PS shards, updated asynchronously) or
    replicated (every table in the trainer, updated synchronously). The export is the same."""
    plan: str = ""
    """A sharding plan YAML (`recserve plan`) to train with instead of --sharding."""
    memory_gb: float = 0.0
    """--sharding auto: memory per node for replicated tables, every rank on a node holding a
    copy (0: half the memory available at start)."""
    plan_sample_rows: int = 100_000
    """--sharding auto: rows of the training data the planner samples."""
    profile: bool = False
    """Log where a training step's time goes (pull, replicated, pool, dense, push; ms per step)."""
    ps: list[str] = field(default_factory=list)
    """Addresses of running PS shards, in shard order; empty: start our own (under torchrun on
    several nodes: shard i on node i mod N, bound to that node's address, see --ps-host)."""
    ps_host: str = ""
    """Without --ps, on several nodes: the address this node's shards bind to; "" = the address
    this node reaches the rendezvous from (one node: loopback)."""
    ps_token_file: str = ""
    """With --ps: the shards' admin token file (mode 0600), needed for updates and dumps. Shards
    we start get a fresh token of their own."""
    inprocess_ps: bool = False
    """Our own shards as in-process stores (InProcessShard) instead of `recserve ps` processes."""
    num_shards: int = 2
    """Shards to start when `ps` is empty."""
    staleness: int = 4
    """K: the most sparse updates a batch's PS rows may miss (0 = sync: each update is applied
    before the next lookup)."""
    prefetch: bool = True
    """With K >= 1, send each step's sparse gradients with the lookup of the batch after next: one
    round trip per PS shard per step, its rows arriving while the next step trains. They miss that
    next step's update (one of the K: the worker runs with K-1)."""
    update_threads: int = 2
    """Worker threads applying sparse updates."""

    # ---- evaluation and output
    eval_batch_size: int = 2048
    """Rows per evaluation batch."""
    store: str = field(default_factory=default_root)
    """Model-store root ($RECSERVE_STORE or ./artifacts)."""
    model: str = "criteo"
    """Model name in the store."""
    export: bool = True
    """Write a version to the model store at the end."""
    publish: bool = False
    """Point CURRENT at the new version."""
    delta_interval_s: float = 0.0
    """Cut an embedding delta into the version every this many seconds (0: off)."""
    delta_rows: int = 0
    """Cut an embedding delta every this many training rows (summed over ranks; 0: off)."""
    checkpoint_every: str = ""
    """Write a checkpoint every this many steps (500) or this long (300s, 10m, 1h); '' : never.
    Dense weights and optimizer state, every PS shard's rows and optimizer state, every rank's data
    position and RNG state, in <store>/<model>/checkpoints (training/checkpoint.py)."""
    checkpoint_keep: int = 2
    """Complete checkpoints kept (the newest)."""
    checkpoint_dir: str = ""
    """Where checkpoints go ('' : <store>/<model>/checkpoints); PS shards dump into it, so it must
    lie under their data root."""
    resume: bool = False
    """Continue from the newest complete checkpoint (none yet: start at step 0, as torchrun's
    --max-restarts needs); the shards' rows, the dense network and the data position go back to it."""
    metrics_port: int = 0
    """Serve Prometheus /metrics (samples, steps, loss, checkpoints, AUC) on this port (0: off);
    under torchrun, the rank with LOCAL_RANK r on a node serves on this port + r."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics port binds to (0.0.0.0 in a pod, for Prometheus to scrape)."""
    curve: str = ""
    """Training-curve SVG path, *.svg ('' : eval/curve.svg in the version, or none without export)."""
    progress: bool = True
    """Show a progress bar."""
    device: str = field(default="auto", metadata={"choices": list(DEVICES)})
    """Where the dense network trains: auto (a GPU where torch sees one, else the CPU), cpu or
    cuda. On GPUs, torchrun's local rank r takes GPU r: a host needs a GPU per rank."""
    threads: int = 0
    """torch intra-op threads (0: half the CPUs, at least 1: the PS shards, the worker's update
    and prefetch threads need the rest; torch's own default of all CPUs oversubscribes them and
    was 10x slower on 2 cores)."""

    @property
    def prefetches(self) -> bool:
        """PS lookups run ahead of the step, with the updates (``--prefetch`` and K >= 1)."""
        return self.prefetch and self.staleness >= 1

    @property
    def rpc_shards(self) -> int:
        """The PS shards a step talks to over RPC: ``--ps``'s, or the ``--num-shards`` we start
        (none with ``--inprocess-ps``: those are stores in this process)."""
        if self.inprocess_ps:
            return 0
        return len(self.ps) if self.ps else self.num_shards

    def store_config(self, schema_hash: str, shard: int = 0, num_shards: int = 1) -> TableShardConfig:
        """The store config of shard ``shard`` of ``num_shards`` (our own shards, the replicated
        tables' store, the planner's measurements): the table spec, nested, not copied."""
        return TableShardConfig(self.table, self.seed, schema_hash, shard, num_shards)

    def __post_init__(self) -> None:
        if isinstance(self.ps, str):
            self.ps = [a for a in self.ps.split(",") if a]
        if isinstance(self.table, dict):
            self.table = TableSpec.from_json(self.table, "TrainConfig.table")
        if self.embeddings not in EMBEDDINGS:
            raise ValueError(f"embeddings must be {' or '.join(EMBEDDINGS)}, got {self.embeddings!r}")
        if self.sharding not in SHARDINGS:
            raise ValueError(f"sharding must be {', '.join(SHARDINGS)}, got {self.sharding!r}")
        if self.arch not in ARCHS:
            raise ValueError(f"arch must be {', '.join(ARCHS)}, got {self.arch!r}")
        if self.memory_gb < 0 or self.plan_sample_rows < 1:
            raise ValueError("memory_gb must be >= 0 and plan_sample_rows >= 1")
        sparse = optim.get(self.table.optimizer.name)  # raises ValueError naming the known ones
        if self.embeddings == "inprocess" and sparse.torch is None:
            raise ValueError(f"--embeddings inprocess: torch has no sparse {sparse.name!r} optimizer")
        if self.epochs < 1 or self.batch_size < 1:
            raise ValueError("epochs and batch_size must be >= 1")
        if self.staleness < 0:
            raise ValueError("staleness must be >= 0")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.ps and self.inprocess_ps:
            raise ValueError("--ps and --inprocess-ps exclude each other")
        if self.shuffle_buffer < 0:
            raise ValueError("shuffle_buffer must be >= 0")
        if self.curve and not self.curve.endswith(".svg"):
            raise ValueError(f"the training curve is an SVG: --curve must end in .svg, got {self.curve!r}")
        from training.checkpoint import parse_every

        if (parse_every(self.checkpoint_every).enabled or self.resume) and self.embeddings == "inprocess":
            raise ValueError("checkpoints need --embeddings ps (the in-process baseline has none)")
        if self.checkpoint_keep < 1:
            raise ValueError("checkpoint_keep must be >= 1")
        from features.stream import ReadOptions

        ReadOptions(format=self.data_format, block_size=self.block_size)  # raises ValueError if bad
        from training import sources

        for spec in (self.data, self.test):
            sources.parse(spec, "files")  # an unknown <kind>:// is a configuration error
        if self.plan:  # a plan that does not fit the schema is a configuration error, not a crash
            from features.schema import load_schema
            from training.planning.plan import ShardingPlan

            ShardingPlan.load(self.plan).check(load_schema(self.schema))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
