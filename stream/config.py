"""``recserve join``'s configuration (flags generated from it by ``recserve.config``) and the
librdkafka settings file every stream role reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from stream import dead_letter
from stream.guard import GuardConfig

QUARANTINE = ".quarantine"
"""The quarantine topic of a samples topic: ``<samples>.quarantine``."""

FETCH_WAIT_MS = 50
"""librdkafka's ``fetch.wait.max.ms`` for the stream's consumers (the joiner's, the trainer's),
unless a settings file says otherwise. The default, 500 ms, is how long a broker may hold a fetch
that found nothing; a real broker answers as soon as records arrive, but librdkafka's mock cluster
holds it the whole time, and that alone put 0-0.6 s (p50 0.3 s) between a click and its joined
sample in bench-stream. 50 ms costs a few more fetch requests a second on an idle topic."""


def kafka_settings(path: str) -> dict[str, str]:
    """librdkafka settings from a file, one ``KEY=VALUE`` a line (``#`` comments, blank lines):
    ``security.protocol``, ``sasl.*``, ``ssl.*`` and any other client setting, kept out of the
    command line (and so out of ``ps``) because they hold secrets. '' -> none."""
    if not path:
        return {}
    settings = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{path}:{n}: expected KEY=VALUE (a librdkafka setting), got {line!r}")
        settings[key.strip()] = value.strip()
    return settings


@dataclass
class JoinConfig:
    """One joiner: a member of a consumer group joining impressions and events into samples."""

    brokers: str = "127.0.0.1:9092"
    """Kafka bootstrap servers, host:port,host:port."""
    impressions: str = "impressions"
    """Topic of impressions (keyed by request id; as many partitions as the events topic)."""
    events: str = "events"
    """Topic of events {request_id, item, label, ts} (keyed by request id)."""
    samples: str = "samples"
    """Topic the labelled samples go to (keyed by request id)."""
    dead_letter: str = ""
    """Topic every refused input record goes to; '' (the default): the dead-letter topic of the
    topic it was read from, impressions.dead and events.dead (the convention: stream/dead_letter.py)."""
    group: str = "recserve-join"
    """Consumer group: N joiners in one group split the partitions (the group also holds the
    committed offsets with --member)."""
    member: str = ""
    """I/N: this joiner takes the partitions p with p % N == I itself, no group rebalancing, so a
    restarted joiner reads again at once instead of after the group's session timeout (run N of
    them, one per I: a StatefulSet's ordinals). '': the group splits the partitions."""
    label_after_s: float = 300.0
    """An item's first sample is emitted this long (event time) after it was scored: positive if
    its click came within it, else negative (the loop's freshness: short)."""
    attribution_s: float = 0.0
    """A click still counts this long (event time) after the impression: one after
    --label-after-s emits a correcting positive sample of the item (minutes to days; 0: none, a
    click after --label-after-s is late). Needs a --state-dir that outlives a restart."""
    events_idle_s: float = 10.0
    """A window's negatives wait for an event past its close (the click pipeline has delivered up
    to it) until the events partition has been silent this long: a pipeline that stops while
    impressions flow then emits no negative without its positives before the input guard trips
    (within --guard-window-s), and an events partition quieter than a click every few seconds
    closes its windows up to this late (0: on the impressions' clock alone)."""
    state_dir: str = ""
    """With --attribution-s: where the impressions of requests past --label-after-s wait for their
    late clicks, with the journal of those requests, on local disk (about the impressions' bytes
    per second x --attribution-s; '': <tmp>/recserve-join/<group>). A restart on the same
    directory resumes from it; give each --member its own persistent volume."""
    kafka_config: str = ""
    """File of librdkafka settings, KEY=VALUE a line (security.protocol, sasl.*, ssl.*, ...)."""
    commit_every_s: float = 1.0
    """How often the input offsets whose samples are all acknowledged are committed."""
    batch: int = 5000
    """Records consumed per poll."""
    host: str = "127.0.0.1"
    """Interface the /metrics port binds."""
    metrics_port: int = 0
    """Prometheus /metrics HTTP port (0: off)."""
    quarantine: str = ""
    """Topic the samples of windows the input guard held to its bound go to; '' (the default):
    <samples>.quarantine. ``recserve join --replay-quarantine`` moves them to the samples topic."""
    record_to: str = field(default="", metadata={"metavar": "MODEL_DIR"})
    """A model directory (<store>/<model>) whose GUARDS.log records the input guard's trips and
    recoveries, shown by `recserve versions` ('': none; they are on /metrics and in the log)."""
    replay_quarantine: bool = False
    """Move the quarantined samples to the samples topic (from where the last replay ended) and
    exit, instead of joining: once the stretch the guard held is judged good."""
    guard: GuardConfig = field(default_factory=GuardConfig)
    """The input guard (stream/guard.py)."""

    def __post_init__(self) -> None:
        if not self.label_after_s > 0:
            raise ValueError(f"--label-after-s must be > 0, got {self.label_after_s}")
        if self.attribution_s and not self.attribution_s >= self.label_after_s:
            raise ValueError(f"--attribution-s must be 0 (no corrections) or >= --label-after-s "
                             f"({self.label_after_s:g}), got {self.attribution_s:g}")  # fmt: skip
        if self.batch < 1 or self.commit_every_s <= 0:
            raise ValueError("batch must be >= 1 and commit_every_s > 0")
        if self.events_idle_s < 0:
            raise ValueError(
                f"--events-idle-s must be >= 0 (0: windows close on the impressions' clock alone), got {self.events_idle_s:g}"
            )
        self.members()  # checks the form
        names = [
            self.impressions,
            self.events,
            self.samples,
            self.quarantine_topic(),
            *sorted(set(self.dead_letters())),
        ]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"the topics must be named and distinct, got {names}")

    def spill_bucket_s(self) -> float:
        """How much event time one spill segment covers: a sixteenth of the attribution window."""
        return max(self.attribution_s / 16, 1.0)

    def quarantine_topic(self) -> str:
        return self.quarantine or self.samples + QUARANTINE

    def dead_letters(self) -> tuple[str, str]:
        """The dead-letter topics of (impressions, events)."""
        if self.dead_letter:
            return self.dead_letter, self.dead_letter
        return dead_letter.topic_of(self.impressions), dead_letter.topic_of(self.events)

    def members(self) -> tuple[int, int] | None:
        """``member`` as (I, N); None without one. ValueError unless 0 <= I < N."""
        if not self.member:
            return None
        i, sep, n = self.member.partition("/")
        if not (sep and i.isdigit() and n.isdigit() and int(i) < int(n)):
            raise ValueError(f"member must be I/N with 0 <= I < N (e.g. 0/2), got {self.member!r}")
        return int(i), int(n)
