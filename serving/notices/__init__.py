r"""Update notices: serving learns of a new delta or version when it is written, not at its next poll.

Whoever writes a delta's ``_SUCCESS`` (``recserve train --follow``, ``training.follow.cut.DeltaWriter``)
or moves ``CURRENT`` (``recserve publish``/``rollback``) announces it; every serving process (PS
shards, co-located frontends) listens and runs its follower's poll at once. The notice only names
what to load; the store stays the source of truth (the follower reads, checks and applies the files
as it does on a poll), and the poll stays, slower, as the fallback for a notice that never came.

**Notice** (``record``: one JSON object, the one reader is ``decode``)::

    {"model": "criteo", "version": "3", "delta_seq": 7, "ts": 1767225600.25}

``delta_seq`` -1 names the version itself (``CURRENT`` moved to it), N >= 0 its delta N; ``ts`` is
when the marker was written (seconds since the epoch). No other keys.

A transport is one module of this package that calls ``register(Transport(...))`` (``registry``;
the package imports every module in it), named in a spec as ``<name>[://<where>]`` like
``training.sources``: ``kafka://BROKERS/TOPIC`` (one topic per model; each process reads every
partition from its end with its own consumer, so every process sees every notice) and ``inotify`` (the kernel's file events on the model directory: one host, no announcer
needed, the marker's rename is the notice). ``none`` listens to nothing (the poll alone).

A process holds one ``Notices`` per model directory (``hub``): the listener's thread hands each
notice to every subscriber (a follower's wake-up: ``wake``). A record that is not a notice is
logged and counted (``recserve_notices_total{outcome="malformed"}``), never raised; one of another
model is counted as ``other_model``; ``metrics`` adds whether it listens and the last notice's lag.
"""

from serving.notices.hub import NOTICES, OUTCOMES, Notices, open_notices
from serving.notices.metrics import LAG, LISTENING
from serving.notices.record import VERSION, Notice, NoticeError, decode, encode
from serving.notices.registry import (
    TRANSPORTS,
    Announcer,
    Listener,
    Transport,
    announce,
    announcer,
    discover,
    parse,
    register,
)
from serving.notices.wake import AsyncWake, Wake

__all__ = ["LAG", "LISTENING", "NOTICES", "OUTCOMES", "TRANSPORTS", "VERSION", "Announcer", "AsyncWake",
           "Listener", "Notice", "NoticeError", "Notices", "Transport", "Wake", "announce", "announcer",
           "decode", "encode", "open_notices", "parse", "register"]  # fmt: skip

discover(__name__)
