"""The hosts multi-host tests run on: namespaces that reach each other by address and name, a link
that drops packets when cut, nothing left behind."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from loadtest import netns
from tests.helpers import wait_until

# it answers every connection: a try whose reply came after its client's timeout (a loaded host)
# must not leave the next try refused
SERVER = (
    "import socket,sys\ns=socket.create_server((sys.argv[1], 7000)); print('up', flush=True)\n"
    "while True:\n c,_=s.accept(); c.sendall(b'hi'); c.close()"
)


def _connect(address: str, timeout_s: float) -> bytes:
    with socket.create_connection((address, 7000), timeout=timeout_s) as c:
        return c.recv(2)


def test_hosts_reach_each_other_by_address_and_name(network, tmp_path):
    net = network(2, ["alpha", "beta"])
    a, b = net.hosts
    assert a.address.startswith("198.18.") and b.address.startswith("198.18.")
    found = a.run(["getent", "hosts", "beta"], capture_output=True, text=True, check=True).stdout
    assert found.split()[0] == b.address
    log = tmp_path / "server.log"
    b.popen([sys.executable, "-c", SERVER, b.address], log)
    wait_until(lambda: "up" in log.read_text(), 20, "the server on host beta listens")
    client = "import socket,sys; print(socket.create_connection((sys.argv[1], 7000), timeout=5).recv(2))"
    out = a.run([sys.executable, "-c", client, b.address], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "b'hi'"


def test_a_cut_link_drops_packets_without_a_reset(network, tmp_path):
    net = network(1)
    (host,) = net.hosts
    log = tmp_path / "server.log"
    host.popen([sys.executable, "-c", SERVER, host.address], log)
    wait_until(lambda: "up" in log.read_text(), 20, "the server listens")
    net.cut(host)
    with pytest.raises(TimeoutError):  # no RST, no ICMP: the connect just times out
        _connect(host.address, 0.5)
    net.restore(host)
    assert wait_until(lambda: _try(host.address), 20, "the host answers again") == b"hi"


def _try(address: str) -> bytes | None:
    try:
        return _connect(address, 0.5)
    except OSError:
        return None


def test_a_volume_over_tmp_does_not_hide_a_directory_bound_from_under_tmp(network, tmp_path):
    """A pod mounts an emptyDir at /tmp and the checkout (here under /tmp) at its WORKDIR: the
    checkout is bound before /tmp is covered, whatever order the binds are given in."""
    (host,) = network(1).hosts
    volume, app = tmp_path / "volume", tmp_path / "app"
    volume.mkdir()
    app.mkdir()
    (app / "code").write_text("app")
    (volume / "scratch").write_text("volume")
    assert str(app).startswith("/tmp/")
    target = f"/rs-test-app-{tmp_path.name}"
    # cwd "/": this test's own working directory may lie under /tmp, which the volume covers
    out = host.run(["sh", "-c", f"cat {target}/code /tmp/scratch"], {str(volume): "/tmp", str(app): target},
                   cwd="/", capture_output=True, text=True)  # fmt: skip
    assert (out.returncode, out.stdout) == (0, "appvolume"), out.stderr
    assert netns.mount_order({"/tmp/a": "/tmp", "/tmp/b": "/app"})[0] == ("/tmp/b", "/app")


def test_everything_is_deleted_on_exit_also_on_error():
    if reason := netns.unavailable():
        pytest.skip(reason)
    with pytest.raises(RuntimeError), netns.Network(2) as net:
        tag = net.tag
        raise RuntimeError("a test failed")
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert tag not in listed and tag not in links
