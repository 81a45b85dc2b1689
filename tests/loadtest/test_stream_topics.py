"""loadtest/stream_topics.py: the bench's reader of a whole topic."""

from __future__ import annotations

from loadtest.stream_topics import TOPICS, Collector


class _Msg:
    def __init__(self, partition: int, offset: int) -> None:
        self._partition, self._offset = partition, offset

    def error(self):
        return None

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset


class _Consumer:
    """Hands out the batches given, then nothing."""

    def __init__(self, batches: list[list[_Msg]]) -> None:
        self.batches = batches

    def consume(self, n: int, timeout: float) -> list[_Msg]:
        return self.batches.pop(0) if self.batches else []

    def close(self) -> None:
        pass


def test_the_collector_counts_the_records_the_broker_dropped_before_it_read_them():
    c = Collector("127.0.0.1:1", "impressions", decode=len)  # no broker is asked: the consumer is replaced
    c.consumer.close()
    # partition 0 from its start, then a gap of 3; partition 1 first read at offset 2
    c.consumer = _Consumer([[_Msg(0, 0), _Msg(0, 1), _Msg(1, 2)], [_Msg(0, 5), _Msg(0, 6), _Msg(1, 3)]])
    c.until = [7, 4] + [0] * (TOPICS["impressions"] - 2)
    c.run()
    assert c.parts == [3, 3] and c.next[:2] == [7, 4]
    assert c.skipped == 3 + 2
