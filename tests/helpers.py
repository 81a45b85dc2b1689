"""Small helpers shared by tests."""

from serving.rpc.procs import free_ports


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free right now (the OS picks it)."""
    return free_ports(1, host)[0]


__all__ = ["free_port", "free_ports"]
