"""The test broker (``serving.stream.mockbroker``) reachable from namespace hosts (``loadtest/netns.py``).

librdkafka's mock cluster listens on 127.0.0.1 only and tells clients its brokers are at
127.0.0.1:<port>. ``Bridge`` opens, in each host's network namespace, a listener on 127.0.0.1 at
every broker port and relays each connection to the broker in the caller's namespace: a client on
a host then reaches "127.0.0.1:<port>" as if the broker ran there. One process, no routes: the
listening sockets are made on a thread moved into the host's namespace (``setns``), which is
where a socket stays; the relaying runs on one event loop in the caller's namespace.

    with mockbroker.running() as broker, netns.Network(2) as net, Bridge(net.hosts, broker.bootstrap):
        net.hosts[0].popen(["recserve", "ps-serve", ..., "--notices", f"kafka://{broker.bootstrap}/t"], log)
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import os
import socket
import threading
from collections.abc import Sequence

from loadtest.netns import Host

CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), f"setns: {os.strerror(ctypes.get_errno())}")


def listen_in(host: Host, port: int) -> socket.socket:
    """A socket listening on 127.0.0.1:``port`` in ``host``'s network namespace."""
    out: list = []

    def make() -> None:  # on a thread of its own: setns moves the calling thread only
        try:
            with open(f"/var/run/netns/{host.name}") as ns:
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


class Bridge:
    """Relays 127.0.0.1:<port> of each of ``hosts`` to the broker at 127.0.0.1:<port> here, for
    every port of ``bootstrap`` (host:port,...)."""

    def __init__(self, hosts: Sequence[Host], bootstrap: str):
        self.ports = [int(a.rpartition(":")[2]) for a in bootstrap.split(",")]
        self.sockets = [listen_in(h, p) for h in hosts for p in self.ports]
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="kafka-bridge", daemon=True)
        self._servers: list[asyncio.AbstractServer] = []

    def __enter__(self) -> Bridge:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self) -> None:
        for s in self.sockets:
            relay = functools.partial(self._relay, port=s.getsockname()[1])
            self._servers.append(await asyncio.start_server(relay, sock=s))

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int) -> None:
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return
        for sock in (writer, up_w):
            sock.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer), return_exceptions=True)

    def __exit__(self, *exc) -> None:
        async def stop() -> None:
            for server in self._servers:
                server.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(1 << 16):
            dst.write(data)
            await dst.drain()
    finally:
        dst.close()
