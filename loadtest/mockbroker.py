"""A Kafka cluster for tests, the demo and benches: librdkafka's built-in mock cluster (the one
``test.mock.num.brokers`` starts), held by this process, printing its bootstrap address.

    python -m loadtest.mockbroker [--brokers 3] [--topic NAME:PARTITIONS ...]

prints one line ``BOOTSTRAP=host:port,...`` on stdout once the cluster listens and the topics
exist, then holds the cluster until SIGTERM/SIGINT. With ``--control`` it also reads
``topic NAME[:PARTITIONS]`` lines on stdin to create topics (``running()`` drives it so for tests
and benches) and exits when stdin closes, so a parent that dies takes it along. Any number of
processes produce and consume through it with consumer groups, committed offsets and rebalancing,
as with a real broker.

Not for production: the mock keeps everything in memory, and it does NOT filter aborted
transactions for ``read_committed`` consumers, so no guarantee here rests on transactions. Real
brokers are configured through librdkafka's settings (docs/streaming.md).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import glob
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from serving.rpc.procs import terminate

DEFAULT_PARTITIONS = 4


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int = DEFAULT_PARTITIONS

    @classmethod
    def parse(cls, text: str) -> TopicSpec:
        """``NAME`` or ``NAME:PARTITIONS``."""
        name, _, parts = text.partition(":")
        if not name or (parts and not parts.isdigit()) or (parts and int(parts) < 1):
            raise ValueError(f"topic {text!r}: expected NAME or NAME:PARTITIONS (PARTITIONS >= 1)")
        return cls(name, int(parts) if parts else DEFAULT_PARTITIONS)


def _librdkafka() -> ctypes.CDLL:
    """The librdkafka that confluent-kafka loaded (the wheel bundles one), its mock API typed."""
    import confluent_kafka

    bundled = sorted(glob.glob(os.path.dirname(confluent_kafka.__file__) + ".libs/librdkafka*.so*"))
    path = bundled[0] if bundled else ctypes.util.find_library("rdkafka")
    if not path:
        raise RuntimeError("librdkafka not found (neither bundled with confluent-kafka nor installed)")
    lib = ctypes.CDLL(path)
    vp, cp = ctypes.c_void_p, ctypes.c_char_p
    lib.rd_kafka_conf_new.restype = vp
    lib.rd_kafka_conf_set.argtypes = [vp, cp, cp, cp, ctypes.c_size_t]
    lib.rd_kafka_new.restype = vp
    lib.rd_kafka_new.argtypes = [ctypes.c_int, vp, cp, ctypes.c_size_t]
    lib.rd_kafka_destroy.argtypes = [vp]
    lib.rd_kafka_mock_cluster_new.restype = vp
    lib.rd_kafka_mock_cluster_new.argtypes = [vp, ctypes.c_int]
    lib.rd_kafka_mock_cluster_destroy.argtypes = [vp]
    lib.rd_kafka_mock_cluster_bootstraps.restype = cp
    lib.rd_kafka_mock_cluster_bootstraps.argtypes = [vp]
    lib.rd_kafka_mock_topic_create.argtypes = [vp, cp, ctypes.c_int, ctypes.c_int]
    lib.rd_kafka_mock_set_controller_id.argtypes = [vp, ctypes.c_int32]
    lib.rd_kafka_mock_group_initial_rebalance_delay_ms.argtypes = [vp, ctypes.c_int32]
    return lib


class MockCluster:
    """librdkafka's mock cluster (through its C API: confluent-kafka's Python API cannot create
    topics on it, its admin client waits for a controller the mock does not name), alive until
    ``close``."""

    def __init__(self, brokers: int = 3) -> None:
        if brokers < 1:
            raise ValueError(f"brokers must be >= 1, got {brokers}")
        self._lib = lib = _librdkafka()
        err = ctypes.create_string_buffer(512)
        conf = lib.rd_kafka_conf_new()
        lib.rd_kafka_conf_set(conf, b"log_level", b"3", err, len(err))  # no "no bootstrap.servers" notice
        self._rk = lib.rd_kafka_new(0, conf, err, len(err))  # a producer handle owns the cluster
        if not self._rk:
            raise RuntimeError(f"librdkafka: {err.value.decode()}")
        self._mc = lib.rd_kafka_mock_cluster_new(self._rk, brokers)
        if not self._mc:
            raise RuntimeError("librdkafka could not create a mock cluster")
        self.bootstrap: str = lib.rd_kafka_mock_cluster_bootstraps(self._mc).decode()
        lib.rd_kafka_mock_set_controller_id(self._mc, 1)  # admin clients wait for a controller
        lib.rd_kafka_mock_group_initial_rebalance_delay_ms(self._mc, 100)  # the mock's default: 3 s

    def create_topic(self, topic: TopicSpec) -> None:
        code = self._lib.rd_kafka_mock_topic_create(self._mc, topic.name.encode(), topic.partitions, 1)
        if code:
            raise RuntimeError(f"cannot create topic {topic.name!r}: librdkafka error {code}")

    def close(self) -> None:
        if self._mc:
            self._lib.rd_kafka_mock_cluster_destroy(self._mc)
            self._lib.rd_kafka_destroy(self._rk)
            self._mc = self._rk = None


class Broker:
    """A mock cluster in a child process, driven through its standard input (``--control``)."""

    def __init__(self, proc: subprocess.Popen[str], bootstrap: str) -> None:
        self.proc, self.bootstrap = proc, bootstrap
        self._lock = threading.Lock()

    def create_topic(self, name: str, partitions: int = DEFAULT_PARTITIONS) -> str:
        """Create topic ``name`` (returns the name); an error names what the broker said."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        with self._lock:
            self.proc.stdin.write(f"topic {name}:{partitions}\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline().strip()
        if answer != f"OK {name}":
            raise RuntimeError(f"mock broker: creating topic {name!r}: {answer or 'no answer'}")
        return name


@contextlib.contextmanager
def running(topics: Sequence[TopicSpec] = (), brokers: int = 3) -> Iterator[Broker]:
    """A mock cluster in a child process (``python -m loadtest.mockbroker --control``) for
    the block. Benches and test fixtures use this."""
    cmd = [sys.executable, "-m", "loadtest.mockbroker", "--brokers", str(brokers), "--control"]
    for t in topics:
        cmd += ["--topic", f"{t.name}:{t.partitions}"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line.startswith("BOOTSTRAP="):
            raise RuntimeError(f"mock broker did not start (exit {proc.wait(timeout=10)}): {line!r}")
        yield Broker(proc, line.removeprefix("BOOTSTRAP="))
    finally:
        terminate(proc)


def _control(cluster: MockCluster, stop: threading.Event) -> None:
    """Answer ``topic NAME[:PARTITIONS]`` lines on stdin with ``OK NAME`` or ``ERROR why``; stop
    at EOF (the parent is gone)."""
    for line in sys.stdin:
        verb, _, arg = line.strip().partition(" ")
        try:
            if verb != "topic":
                raise ValueError(f"unknown command {verb!r} (known: topic NAME[:PARTITIONS])")
            spec = TopicSpec.parse(arg)
            cluster.create_topic(spec)
            print(f"OK {spec.name}", flush=True)
        except (ValueError, RuntimeError) as e:
            print(f"ERROR {e}", flush=True)
    stop.set()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.mockbroker", description=__doc__.split("\n\n")[0])
    p.add_argument("--brokers", type=int, default=3, help="number of mock brokers (default: 3)")
    p.add_argument("--topic", action="append", default=[], metavar="NAME[:PARTITIONS]",
                   help=f"create this topic (default {DEFAULT_PARTITIONS} partitions); repeatable")  # fmt: skip
    p.add_argument("--control", action="store_true",
                   help="read 'topic NAME[:PARTITIONS]' lines on stdin (answering 'OK NAME') and exit "
                        "when stdin closes, so a parent that dies takes the broker along")  # fmt: skip
    args = p.parse_args(argv)
    try:
        topics = [TopicSpec.parse(t) for t in args.topic]
        cluster = MockCluster(args.brokers)
        for t in topics:
            cluster.create_topic(t)
    except (ValueError, RuntimeError) as e:
        print(f"mockbroker: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"BOOTSTRAP={cluster.bootstrap}", flush=True)
    if args.control:
        threading.Thread(target=_control, args=(cluster, stop), daemon=True).start()
    stop.wait()
    cluster.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
