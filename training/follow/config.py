"""The streaming trainer's configuration (``recserve train --follow``): ``FollowConfig`` and its
``--full-every`` ``Period``; typed dataclasses (flags and YAML via ``recserve.config``)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from serving.ps.spec import EVICTIONS
from training.follow.delayed import MODES, DelayedFeedback
from training.follow.guard import OutputGuardConfig

_PERIOD = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$")
_SECONDS = {"s": 1.0, "m": 60.0, "h": 3600.0}


@dataclass(frozen=True)
class Period:
    """``--full-every``: a full version every ``seconds`` of training, or every ``deltas`` deltas
    cut (exactly one of the two is set)."""

    seconds: float = 0.0
    deltas: int = 0

    @classmethod
    def parse(cls, text: str) -> Period:
        """``600s``, ``10m``, ``1.5h`` (time) or ``40d`` (deltas); ValueError naming the forms."""
        m = _PERIOD.match(text)
        if m is None:
            raise ValueError(f"--full-every {text!r}: give a time (600s, 10m, 1h) or a count of deltas (40d)")
        number, unit = m.groups()
        if unit == "d":
            if "." in number or int(number) < 1:
                raise ValueError(f"--full-every {text!r}: a count of deltas is a whole number >= 1 (40d)")
            return cls(deltas=int(number))
        seconds = float(number) * _SECONDS[unit]
        if seconds <= 0:
            raise ValueError(f"--full-every {text!r}: a time > 0")
        return cls(seconds=seconds)

    def due(self, seconds: float, deltas: int) -> bool:
        """Whether a full version is due ``seconds`` and ``deltas`` after the last one."""
        return seconds >= self.seconds if self.seconds else deltas >= self.deltas

    def __str__(self) -> str:
        return f"{self.deltas}d" if self.deltas else f"{self.seconds:g}s"


@dataclass
class FollowConfig:
    """`recserve train --follow MODEL_DIR`: keep training the SERVED version's embeddings on new
    data files and cut deltas into it (training/follow/trainer.py). The dense model stays the served one,
    frozen, unless --train-dense (then it ships in the full versions of --full-every)."""

    follow: str = field(default="", metadata={"metavar": "MODEL_DIR"})
    """Model directory (<store>/<model>, e.g. artifacts/criteo) whose CURRENT version is trained
    and receives the deltas: the directory `recserve ps-serve` serves from."""
    watch: str = ""
    """Where the rows come from: a data source <kind>://... (training/sources/), or a directory of
    arriving data files (Criteo .tsv/.txt, or .csv with a header). A file is taken once complete: its
    name does not start with '.' (x.csv.tmp, x.csv.part are not data), and either a `<name>.done`
    marker exists or its size and mtime did not change between two polls."""
    stream: str = field(default="", metadata={"metavar": "kafka://BROKERS/TOPIC"})
    """Instead of --watch: a stream of labelled samples (``recserve join``'s topic). Each delta
    records the partitions' offsets and the sample keys trained; a restart resumes from the last
    published delta's, and a sample whose key was trained already is dropped (exactly once)."""
    dedup_window_s: float = 3600.0
    """--stream: how long (in label time: served, plus the label's delay) a trained sample's key
    is remembered to drop it if it comes again; cover the joiner's --label-after-s plus what a
    restarted joiner replays (with --attribution-s, that window)."""
    delayed_feedback: str = field(default="none", metadata={"choices": list(MODES)})
    """--stream with a joiner's --attribution-s: how the loss counts an item that came as a
    negative and then, corrected, as a positive. none: as they are; fnw: fake negative weighting;
    esdfm: its elapsed-time-aware variant (training/follow/delayed.py, docs/late-clicks.md)."""
    delta_interval_s: float = 2.0
    """Cut a delta every this many seconds when rows changed (and always at the end)."""
    announce: str = field(default="", metadata={"metavar": "kafka://BROKERS/TOPIC"})
    """Announce each delta's _SUCCESS on the model's notice topic, so serving processes that listen
    there (--notices) apply it at once ('': none; one host's serving sees the files by inotify)."""
    metrics_port: int = 0
    """Serve Prometheus /metrics (samples, duplicates, refused, deltas, progressive AUC and log
    loss, offsets, consumer lag: training/follow/book.py) on this port (0: off; torchrun rank r:
    this port + r)."""
    metrics_host: str = "127.0.0.1"
    """Address the metrics port binds to."""
    poll_s: float = 1.0
    """How often to look for new files and a new CURRENT."""
    once: bool = False
    """Train on the complete files present now, cut the delta, exit."""
    max_seconds: float = 0.0
    """Stop (after a final delta) after this many seconds (0: run until SIGTERM/Ctrl-C)."""
    state: str = ""
    """Ledger of the files trained so far (rows done per file), rewritten after every delta;
    '' : <watch>/.recserve-follow-<model>.json (<follow>/... for a source that is no directory)."""
    batch_size: int = 1024
    """Rows per step (--stream: records per consume, all partitions' in one step). A step costs
    far less per row at 1,024 than at 128 (make bench-trainer: about 50,000 against 30,000
    samples/s streaming on 2 vCPUs), and with the rate scaled (--lr unset) learns as much per
    sample."""
    lr: float | None = None
    """Sparse learning rate (None: the version's, times --batch-size over the batch it was trained
    with when its manifest says: 0.005 at 128 is 0.04 at 1,024). Everything else of the table spec
    (dim, dtype, optimizer and its hyper-parameters, TTL, admission) is the version's, read back
    from its shard dumps; capacity, eviction and max_memory_gb are the follower's."""
    staleness: int = 4
    """K: the most sparse updates a batch's rows may miss (a step's update goes with the lookup of
    the batch after next, which misses the update between them: one of the K)."""
    update_threads: int = 2
    """Worker threads applying sparse updates."""
    capacity: int = 1_000_000
    """Initial row capacity of each in-process shard (at least twice the version's rows is used;
    a full shard grows unless --eviction is lru or lfu)."""
    eviction: str = field(default="none", metadata={"choices": list(EVICTIONS)})
    """What a full shard does: none (grow up to --max-memory-gb), lru or lfu (evict, counted)."""
    max_memory_gb: float = 0.0
    """Memory limit of each shard's store in GiB (0 = none); past it training stops loudly."""
    threads: int = 0
    """torch intra-op threads (0: half the CPUs, at least 1)."""
    full_every: str = field(default="", metadata={"metavar": "600s|10m|40d"})
    """Write and publish a full version (rows with optimizer state, the dense network, its
    manifest) every this much time (s, m, h) or this many deltas (d); '' : never (deltas only).
    training/follow/full_version.py."""
    train_dense: bool = False
    """Train the dense network too (needs --full-every: dense changes ship only in full versions;
    deltas carry rows into the served version, which keeps its own dense network)."""
    dense_lr: float = 1e-3
    """--train-dense: Adam learning rate of the dense network."""
    max_auc_drop: float = 0.01
    """The gate refuses a full version whose progressive AUC on its window is more than this below
    the served version's on the same samples (refused versions are logged, counted and listed)."""
    canary_share: float = 0.0
    """With --full-every: instead of publishing a full version, start it as the candidate arm of a
    new experiment (canary-<version>) serving this share of the units, in [0, 0.5]; the
    experiment's rule (recserve experiment watch --auto) or an operator publishes or drops it. One
    canary at a time; it gets no deltas while a candidate (training/follow/canary.py). 0: off."""
    guard: OutputGuardConfig = field(default_factory=OutputGuardConfig)
    """--stream, one process: the output guard (training/follow/guard.py)."""
    keep_versions: int = 3
    """With --full-every: keep the newest K complete versions (never CURRENT, the version published
    before it, or a pinned one: model_store/retention.py)."""

    def __post_init__(self) -> None:
        if self.full_every:
            Period.parse(self.full_every)  # a clear error now, not at the first full version
        elif self.train_dense:
            raise ValueError("--train-dense needs --full-every: dense changes ship only in full versions")
        if not 0.0 <= self.canary_share <= 0.5:  # NaN fails too
            raise ValueError(f"--canary-share must be in [0, 0.5], got {self.canary_share}")
        if self.canary_share and not self.full_every:
            raise ValueError("--canary-share needs --full-every: a canary is a full version")
        if self.keep_versions < 1 or not self.dense_lr > 0 or not self.max_auc_drop >= 0:
            raise ValueError("keep_versions must be >= 1, dense_lr > 0, max_auc_drop >= 0")
        if not self.follow or bool(self.watch) == bool(self.stream):
            raise ValueError(
                "continuous training needs --follow MODEL_DIR and one of --watch DIR, --stream kafka://BROKERS/TOPIC"
            )
        from training import sources

        sources.parse(*self.source)  # an unknown <kind>:// is a configuration error
        DelayedFeedback(self.delayed_feedback)  # a clear error now
        if self.dedup_window_s <= 0:
            raise ValueError(f"dedup_window_s must be > 0, got {self.dedup_window_s}")
        if self.delta_interval_s <= 0 or self.poll_s <= 0:
            raise ValueError("delta_interval_s and poll_s must be > 0")
        if self.batch_size < 1 or self.staleness < 0 or self.max_seconds < 0:
            raise ValueError("batch_size must be >= 1, staleness and max_seconds >= 0")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")

    @property
    def full_period(self) -> Period | None:
        """--full-every as its typed value (None: no full versions)."""
        return Period.parse(self.full_every) if self.full_every else None

    @property
    def source(self) -> tuple[str, str]:
        """(spec, the kind a spec without a scheme names) of the rows followed."""
        return (self.stream, "kafka") if self.stream else (self.watch, "watch")

    @property
    def ledger(self) -> Path:
        """The follow ledger (rank 0's under torchrun: ``training.sources.ledger.ledger_path``):
        --state, else beside the rows: in the watched directory, or the model's directory for a
        source that is not one."""
        if self.state:
            return Path(self.state)
        from training import sources

        kind, where = sources.parse(*self.source)
        return (
            Path(where) if kind.name == "watch" else Path(self.follow)
        ) / f".recserve-follow-{self.model}.json"

    @property
    def store(self) -> str:
        """The model-store root: the parent of the model directory."""
        return str(Path(self.follow).parent)

    @property
    def model(self) -> str:
        """The model's name: the model directory's name."""
        return Path(self.follow).name
