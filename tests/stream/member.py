"""A consumer-group member for the broker tests, as its own process:

    python -m tests.stream.member BOOTSTRAP TOPIC GROUP

prints ``ASSIGNED p,q,...`` after every rebalance and ``GOT partition offset`` per record, and
commits each record's offset synchronously before printing it."""

from __future__ import annotations

import sys

from confluent_kafka import Consumer


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
        c.commit(msg, asynchronous=False)
        print(f"GOT {msg.partition()} {msg.offset()}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
