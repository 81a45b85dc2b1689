"""Hosts for multi-host tests and benchmarks: Linux network namespaces joined by a bridge.

``Network(n)`` builds ``n`` namespaces, each a "host" with its own loopback and one interface
``eth0`` addressed in 198.18.0.0/15 (the range reserved for benchmarking, RFC 2544), joined by a
bridge in the caller's namespace that holds the subnet's ``.254`` so the caller can reach every
host too. Nothing is routed anywhere else: a host reaches only its peers, the caller and itself.

    with Network(3) as net:
        ps = net.hosts[0].popen(["recserve", "ps", "--host", net.hosts[0].address, ...], log)
        net.cut(net.hosts[0])      # its link drops every packet (no reset, no error): a host lost
        net.restore(net.hosts[0])

``hostnames`` may give a host several names (space-separated, as in /etc/hosts), but never give
one name to two hosts: gRPC's resolver (c-ares) merges /etc/hosts lines that share a name, so every
name of both lines would resolve to the first line's address.

Everything is deleted on exit, on error too, and a later ``Network`` deletes what a killed run
left (names carry the creating pid). Needs root (CAP_SYS_ADMIN + CAP_NET_ADMIN) and ``ip``
(iproute2): ``unavailable()`` says why not, for a test to skip with.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from serving.rpc.procs import alive, stop_children

PREFIX = "rsn"  # every namespace, veth and bridge this module makes starts with it
NETNS_ETC = Path("/etc/netns")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str:
    """'' when network namespaces can be made here, else the reason they cannot."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add` is refused)"
    probe = f"{PREFIX}probe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is refused: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return ""


@dataclass
class Host:
    """One namespace: ``name`` (``ip netns exec`` target), ``address`` on the bridge, ``hostname``
    (resolvable on every host of the network through ``/etc/netns/<ns>/hosts``)."""

    name: str
    address: str
    hostname: str
    veth: str  # the caller-side end of its link (cut() takes it down)
    procs: list[subprocess.Popen] = field(default_factory=list)

    made: list[str] = field(default_factory=list)  # mount points made for binds (removed at close)

    def argv(self, argv: list[str], binds: dict[str, str] | None = None) -> list[str]:
        """``argv`` run inside this host: its network namespace, a UTS namespace of its own with
        the host's first name as hostname (as a real host has: torchrun's rendezvous, for one,
        finds itself by its hostname), and with ``binds`` {directory: path} bind-mounted in a mount
        namespace of its own (a volume at its mount path, the store where every host mounts it),
        the mount points made where missing; a working directory (``cwd=``) under a bind is
        entered after the mounts."""
        binds = binds or {}
        for target in binds.values():
            if not os.path.isdir(target):
                os.makedirs(target)
                self.made.append(target)
        script = f"hostname {shlex.quote(self.hostname.split()[0])} && "
        script += "".join(
            f"mount --bind {shlex.quote(s)} {shlex.quote(t)} && " for s, t in mount_order(binds)
        )
        mounts = ["--mount", "--propagation", "private"] if binds else []
        return ["ip", "netns", "exec", self.name, "unshare", "--uts", *mounts,
                "sh", "-c", script + 'cd "$PWD" && exec "$@"', "sh", *argv]  # fmt: skip

    def popen(
        self,
        argv: list[str],
        log: str | Path,
        env: dict | None = None,
        binds: dict[str, str] | None = None,
        **kw,
    ) -> subprocess.Popen:
        """Start ``argv`` on this host, stdout and stderr to ``log``; stopped with the network."""
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                self.argv(argv, binds),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                **kw,
            )
        self.procs.append(proc)
        return proc

    def run(self, argv: list[str], binds: dict[str, str] | None = None, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` on this host to completion (``subprocess.run`` keywords)."""
        return subprocess.run(self.argv(argv, binds), **kw)


def mount_order(binds: dict[str, str]) -> list[tuple[str, str]]:
    """``binds`` in an order where no mount hides a directory a later one binds from: a volume
    mounted at /tmp would otherwise hide a checkout or a store under /tmp before it is bound. Binds
    whose target holds another bind's source go last, shallower targets before deeper ones."""
    sources = [Path(s) for s in binds]

    def hides(target: str) -> bool:
        return any(s == Path(target) or Path(target) in s.parents for s in sources)

    return sorted(binds.items(), key=lambda st: (hides(st[1]), len(Path(st[1]).parts)))


class Network:
    """``n`` hosts on one bridge, subnet 198.18.<k>.0/24 (k from the pid, so concurrent runs do not
    collide; ``subnet="198.18.0"`` fixes it, for lines printed with their addresses). Use as a context manager; ``close()`` stops every process started on a host (SIGTERM,
    then SIGKILL) and deletes the namespaces, links and bridge."""

    def __init__(self, n: int, hostnames: list[str] | None = None, subnet: str = ""):
        if not 1 <= n <= 200:
            raise ValueError(f"1..200 hosts, not {n}")
        if hostnames is not None and len(hostnames) != n:
            raise ValueError(f"{n} hosts but {len(hostnames)} hostnames")
        if subnet and not re.fullmatch(r"198\.1[89]\.(25[0-5]|2[0-4]\d|1?\d?\d)", subnet):
            raise ValueError(f"subnet {subnet!r}: give the first three octets of a /24 in 198.18.0.0/15")
        self.tag = f"{PREFIX}{os.getpid()}"  # <= 15 characters with its suffixes
        self.subnet = subnet or f"198.18.{1 + os.getpid() % 249}"  # hosts .1, .2, ...; 198.18.0: tests' own
        self.bridge = f"{self.tag}br"
        self.gateway = f"{self.subnet}.254"  # the caller's address on the bridge
        self.hosts: list[Host] = []
        self._names = hostnames or [f"host{i}" for i in range(n)]
        self._n = n

    # ---- lifecycle --------------------------------------------------------------------------
    def __enter__(self) -> Network:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def open(self) -> None:
        sweep_stale()
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self._n):
            ns, outer = f"{self.tag}h{i}", f"{self.tag}v{i}"
            host = Host(ns, f"{self.subnet}.{i + 1}", self._names[i], outer)
            self.hosts.append(host)
            _ip("netns", "add", ns)
            _ip("link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        lines = "".join(f"{h.address} {h.hostname}\n" for h in self.hosts)
        for host in self.hosts:  # `ip netns exec` bind-mounts these over /etc/hosts
            etc = NETNS_ETC / host.name
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(f"127.0.0.1 localhost\n{lines}")

    def close(self) -> None:
        for host in self.hosts:
            stop_children(host.procs)
            _kill_namespace_pids(host.name)
        for host in self.hosts:
            for target in reversed(host.made):
                try:
                    os.rmdir(target)
                except OSError:  # in use or not empty: left as it is
                    pass
            _ip("link", "del", host.veth, check=False)
            _ip("netns", "del", host.name, check=False)
            shutil.rmtree(NETNS_ETC / host.name, ignore_errors=True)
        _ip("link", "del", self.bridge, check=False)
        self.hosts = []

    # ---- faults -----------------------------------------------------------------------------
    def cut(self, host: Host) -> None:
        """Take ``host``'s link down at the bridge: every packet to or from it is dropped, with no
        connection reset and no error on either side (a host that vanished, not a process that
        died)."""
        _ip("link", "set", host.veth, "down")

    def restore(self, host: Host) -> None:
        _ip("link", "set", host.veth, "up")


def _kill_namespace_pids(ns: str) -> None:
    """SIGKILL whatever still runs in ``ns`` (a grandchild that left its session)."""
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def sweep_stale() -> None:
    """Delete the namespaces, links and bridges a killed run left (its pid no longer runs)."""
    pattern = re.compile(rf"{PREFIX}(\d+)(?:h|v|br)\d*$")

    def stale(name: str) -> bool:
        m = pattern.match(name)
        return m is not None and not alive(int(m.group(1)))

    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split(" ")[0]
        if stale(name):
            _kill_namespace_pids(name)
            _ip("netns", "del", name, check=False)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(": ")
        if len(parts) > 1 and stale(parts[1].split("@")[0]):
            _ip("link", "del", parts[1].split("@")[0], check=False)
