"""Small helpers shared by tests."""

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now (the OS picks it)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct free ports: all sockets stay open until every port is picked."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
