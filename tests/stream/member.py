"""A consumer-group member for the broker tests, as its own process:

    python -m tests.stream.member BOOTSTRAP TOPIC GROUP

prints ``ASSIGNED p,q,...`` after every rebalance and, per record, commits its offset
synchronously and prints ``GOT partition offset``. A commit the group refuses (any KafkaException;
REBALANCE_IN_PROGRESS while it rebalances is the one the tests meet) is printed ``UNCOMMITTED
partition offset error`` and the member goes on, as the joiner does: the partition's next owner
starts from its committed offset and reads the record again, and a record no owner reads again is
missing from the GOT lines the tests count."""

from __future__ import annotations

import sys

from confluent_kafka import Consumer, KafkaException


def main(bootstrap: str, topic: str, group: str) -> None:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "auto.offset.reset": "earliest",
                  "enable.auto.commit": False, "session.timeout.ms": 6000, "heartbeat.interval.ms": 500})  # fmt: skip

    def assigned(consumer, parts):
        print("ASSIGNED " + ",".join(str(p.partition) for p in parts), flush=True)

    c.subscribe([topic], on_assign=assigned)
    while True:
        msg = c.poll(0.5)
        if msg is None or msg.error():
            continue
        try:
            c.commit(msg, asynchronous=False)
        except KafkaException as e:
            print(f"UNCOMMITTED {msg.partition()} {msg.offset()} {e.args[0].name()}", flush=True)
            continue
        print(f"GOT {msg.partition()} {msg.offset()}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
