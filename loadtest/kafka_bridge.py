"""The test broker (``loadtest.mockbroker``) reachable from namespace hosts (``loadtest/netns.py``).

librdkafka's mock cluster listens on 127.0.0.1 only and tells clients its brokers are at
127.0.0.1:<port>. The bridge opens, in each host's network namespace, a listener on 127.0.0.1 at
every broker port and relays each connection to the broker in the caller's namespace: a client on
a host then reaches "127.0.0.1:<port>" as if the broker ran there. No routes: the listening
sockets are made on a thread moved into the host's namespace (``setns``), which is where a socket
stays; the relaying runs on one event loop in the caller's namespace, in a process of its own
(``running``), so a bench's own work never holds up the records it measures.

    with mockbroker.running() as broker, netns.Network(2) as net, running(net.hosts, broker.bootstrap):
        net.hosts[0].popen(["recserve", "ps-serve", ..., "--notices", f"kafka://{broker.bootstrap}/t"], log)

    python -m loadtest.kafka_bridge --bootstrap 127.0.0.1:PORT[,...] NAMESPACE...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence

from loadtest.netns import Host
from serving.rpc.procs import terminate

CLONE_NEWNET = 0x40000000
READY = "READY"


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), f"setns: {os.strerror(ctypes.get_errno())}")


def listen_in(namespace: str, port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:``port`` in the network namespace ``namespace``."""
    out: list = []

    def make() -> None:  # on a thread of its own: setns moves the calling thread only
        try:
            with open(f"/var/run/netns/{namespace}") as ns:
                _setns(ns.fileno())
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen(64)
            s.setblocking(False)
            out.append(s)
        except OSError as e:
            out.append(e)

    t = threading.Thread(target=make)  # it ends in the host's namespace: never reused
    t.start()
    t.join()
    if isinstance(out[0], OSError):
        raise out[0]
    return out[0]


async def serve(namespaces: Sequence[str], bootstrap: str) -> None:
    """Relay 127.0.0.1:<port> of each namespace to 127.0.0.1:<port> here, for every port of
    ``bootstrap`` (host:port,...), until cancelled."""
    ports = [int(a.rpartition(":")[2]) for a in bootstrap.split(",")]
    servers = []
    for ns in namespaces:
        for port in ports:
            relay = functools.partial(_relay, port=port)
            servers.append(await asyncio.start_server(relay, sock=listen_in(ns, port)))
    print(READY, flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for server in servers:
            server.close()


async def _relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int) -> None:
    try:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        writer.close()
        return
    for w in (writer, up_w):
        w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer), return_exceptions=True)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(1 << 16):
            dst.write(data)
            await dst.drain()
    finally:
        dst.close()


@contextlib.contextmanager
def running(hosts: Sequence[Host], bootstrap: str) -> Iterator[subprocess.Popen]:
    """The bridge for ``hosts`` in a child process, listening, for the block."""
    cmd = [sys.executable, "-m", "loadtest.kafka_bridge", "--bootstrap", bootstrap, *(h.name for h in hosts)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if line != READY:
            raise RuntimeError(f"kafka bridge did not start (exit {proc.wait(timeout=10)}): {line!r}")
        yield proc
    finally:
        terminate(proc)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.kafka_bridge", description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", required=True, help="the broker's host:port,... (127.0.0.1 ports)")
    p.add_argument("namespaces", nargs="+", help="network namespaces to open the broker's ports in")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.namespaces, args.bootstrap))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
