"""Impressions read back by offset, for the corrections of ``recserve join --attribution-s``: once a
request's first horizon closes the join keeps only where its impression lies, and a click that comes
later (a correction) needs its rows again.

One consumer of its own (no group membership: ``assign``, never ``subscribe``; nothing committed)
reads the offsets the partitions' joins want, batched: offsets less than ``GAP`` apart are read in
one pass, further ones after a seek. An offset the topic no longer holds (its retention passed it)
comes back as None: the join counts the correction lost (``recserve_join_corrections_lost``), which
is why the impressions' retention must cover the attribution window.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition

from stream.join import Emit, PartitionJoin

GAP = 256
"""Offsets at most this far apart are read in one pass rather than each after a seek."""


class ImpressionReader:
    def __init__(self, settings: dict[str, Any], topic: str, timeout_s: float = 10.0) -> None:
        self.topic, self.timeout_s = topic, timeout_s
        self.consumer = Consumer({**settings, "group.id": "recserve-join-readback", "enable.auto.commit": False,
                                  "enable.partition.eof": True, "auto.offset.reset": "earliest"})  # fmt: skip

    def read(self, partition: int, offsets: list[int]) -> dict[int, bytes | None]:
        """The record at each of ``offsets`` (None: the partition no longer holds it)."""
        out: dict[int, bytes | None] = {}
        want = sorted(set(offsets))
        runs, start = [], 0
        for i in range(1, len(want) + 1):
            if i == len(want) or want[i] - want[i - 1] > GAP:
                runs.append(want[start:i])
                start = i
        for run in runs:
            out.update(self._run(partition, run))
        return out

    def _run(self, partition: int, run: list[int]) -> dict[int, bytes | None]:
        """Read from ``run[0]`` to ``run[-1]``: the records at the offsets of ``run``."""
        wanted, got = set(run), dict.fromkeys(run)
        self.consumer.assign([TopicPartition(self.topic, partition, run[0])])
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            for m in self.consumer.consume(500, timeout=0.2):
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        return got  # the end of the partition: the rest is not there
                    continue
                offset = m.offset()
                if offset is not None and offset in wanted:
                    got[offset] = m.value()
                if offset is not None and offset >= run[-1]:
                    return got
        raise TimeoutError(f"reading back impressions {run[0]}..{run[-1]} of {self.topic} [{partition}] "
                           f"took over {self.timeout_s:g} s")  # fmt: skip

    def corrections(self, parts: dict[int, PartitionJoin]) -> Iterator[tuple[int, list[Emit]]]:
        """Each partition's corrections whose impressions were read back now."""
        for p, part in list(parts.items()):
            wanted = part.wanted()
            if wanted:
                read = self.read(p, wanted)
                yield p, [e for offset in wanted for e in part.fetched(offset, read[offset])]

    def close(self) -> None:
        self.consumer.close()
