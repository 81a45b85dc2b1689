"""Serving across hosts under load, with a host lost: the roles of docs/hosts.md "Running on several
hosts" spread over network namespaces (``loadtest/netns.py``), each PS shard replicated on two
hosts and the frontend given two workers on two others::

    host A, host B   recserve ps-serve <store>/criteo     shards 0 and 1 on each (replicas)
    host C, host D   recserve worker --ps A:0|B:0,A:1|B:1
    host E           recserve serve --lookups remote --worker C|D

A host is lost by cutting its link (``Network.cut``: every packet dropped, no reset): lookups to
it time out within their share of the request's deadline and go to its twin
(``serving.rpc.failover``), and it rejoins when its health answers again. Load is locust
(``loadtest/locust_timeline.py``) from the root namespace; every request's outcome and versions
are kept. ``loadtest/bench_multihost.py`` measures with it; ``tests/loadtest/test_multihost_serving.py``
runs a short window of the same.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loadtest import netns
from loadtest.common import ROOT, read_timeline, start_locust_timeline, train_version
from loadtest.processes import grpc_serving, http_ok, venv_env, wait_for

MOUNT = "/mnt/recserve"  # where every host mounts the store
PS_PORTS = (50061, 50062)  # shard 0, shard 1 on each PS host
WORKER_PORT = 50071
HTTP_PORT = 8080


@dataclass
class Roles:
    """The serving roles on ``hosts`` (PS replicas on the first two, workers on the next two, the
    frontend on the last; one host may stand for several on a one-host run, the ports then kept
    apart), the store bound at ``MOUNT`` on each."""

    hosts: list[netns.Host]  # A, B, C, D, E
    store: Path
    logs: Path
    procs: list = field(default_factory=list)

    def __post_init__(self) -> None:
        a, b, c, d, e = self.hosts
        one = len({h.name for h in self.hosts}) == 1  # every role on one host: other ports
        self.ps = [(h, shard, port + (10 * k if one else 0))
                   for k, h in enumerate((a, b)) for shard, port in enumerate(PS_PORTS)]  # fmt: skip
        self.workers = [(h, WORKER_PORT + (k if one else 0)) for k, h in enumerate((c, d))]
        self.frontend = e

    def argv(self) -> list[tuple[netns.Host, str, list[str]]]:
        """(host, name, argv) of every role."""
        out = []
        for h, shard, port in self.ps:
            out.append((h, f"ps{shard}-{h.hostname.split()[0]}-{port}", ["recserve", "ps-serve", f"{MOUNT}/criteo", "--host", h.address,
                        "--port", str(port), "--shard", str(shard), "--num-shards", "2"]))  # fmt: skip
        spec = ",".join("|".join(f"{h.address}:{p}" for h, s, p in self.ps if s == shard) for shard in (0, 1))
        for h, port in self.workers:
            out.append((h, f"worker-{h.hostname.split()[0]}-{port}", ["recserve", "worker", "--host", h.address, "--port", str(port),
                        "--ps", spec]))  # fmt: skip
        workers = "|".join(f"{h.address}:{p}" for h, p in self.workers)
        out.append((self.frontend, "serve", ["recserve", "serve", "--workers", "1", "--host", self.frontend.address, "--store", MOUNT,
                    "--model", "criteo", "--lookups", "remote", "--worker", workers]))  # fmt: skip
        return out

    @property
    def url(self) -> str:
        return f"http://{self.frontend.address}:{HTTP_PORT}"

    @property
    def key_file(self) -> str:
        return str(self.store / ".run" / "criteo" / "serve-key_file.json")

    def start(self, timeout_s: float = 180.0) -> Roles:
        env = venv_env()
        for host, name, argv in self.argv():
            if name == "serve":  # the workers and shards first: serve warms up through them
                self.wait(lambda: all(grpc_serving(f"{h.address}:{p}", 0.5)() for h, _, p in self.ps), timeout_s,
                          "every PS replica SERVING")  # fmt: skip
            log = self.logs / f"{name}.log"
            self.procs.append(
                (name, host.popen(argv, log, env=env, binds={str(self.store): MOUNT}, cwd=ROOT), log)
            )
        self.wait(http_ok(f"{self.url}/ping"), timeout_s, f"{self.url}/ping 200")
        return self

    def wait(self, predicate, timeout_s: float, what: str) -> None:
        """``predicate`` true within ``timeout_s``; a role that exits first fails with its log."""
        wait_for(predicate, timeout_s, what, self.procs)

    def rejoined(self, host: netns.Host) -> bool:
        """Every PS replica and worker on ``host`` answers SERVING to its health check again."""
        addresses = [f"{h.address}:{p}" for h, _, p in self.ps if h is host]
        addresses += [f"{h.address}:{p}" for h, p in self.workers if h is host]
        return all(grpc_serving(a, 0.5)() for a in addresses)

    def stop(self) -> None:
        from serving.rpc.procs import stop_children

        stop_children([p for _, p, _ in self.procs], 10.0)


def under_load(roles: Roles, rate: int, duration_s: int, out: Path, events: list, at_s: list[float]) -> dict:
    """Locust at ``rate`` for ``duration_s`` while ``events[i]()`` runs at ``at_s[i]`` s into
    it; returns the window's figures: requests, failures (and those after the first event),
    mixed responses, p50/p99 of the requests before the first event and over the window."""
    proc = start_locust_timeline(roles.url, rate, duration_s, out, key_file=roles.key_file)
    t0 = time.time()
    marks = []
    for fn, at in zip(events, at_s, strict=True):
        time.sleep(max(0.0, t0 + at - time.time()))  # the schedule of the run, not a wait on a fact
        marks.append(time.time())
        fn()
    _, err = proc.communicate(timeout=duration_s + 120)
    tl = read_timeline(out)
    if not len(tl):
        raise RuntimeError(f"locust recorded no request: {err[-2000:]}")
    end, ms, failed, mixed = tl[:, 0], tl[:, 1], tl[:, 2].astype(bool), tl[:, 3].astype(bool)
    first = marks[0] if marks else float("inf")
    steady = ms[end < first] if (end < first).any() else ms
    return {
        "requests": int(len(tl)),
        "failures": int(failed.sum()),
        "failures_after_event": int(failed[end >= first].sum()),
        "mixed_responses": int(mixed.sum()),
        "p50_ms": round(float(np.percentile(ms[~failed], 50)), 2) if (~failed).any() else None,
        "p99_ms": round(float(np.percentile(ms[~failed], 99)), 2) if (~failed).any() else None,
        "p99_steady_ms": round(float(np.percentile(steady, 99)), 2),
        "max_ms": round(float(ms.max()), 1),
        "rate": rate,
        "duration_s": duration_s,
    }


def measure(quick: bool = False) -> dict:
    """failures_host_down, failures_worker_down, mixed_responses (a retrained version published and
    switching in across the hosts under load), p99 across hosts against the same roles on one host. ``quick``:
    5 s windows instead of 60, and no one-host comparison (its figures None)."""
    import tempfile

    from model_store.releases import publish

    rate, window = 50, (5 if quick else 60)
    out: dict = {"rate": rate, "window_s": window}
    with tempfile.TemporaryDirectory(prefix="recserve-multihost-") as tmp:
        work = Path(tmp)
        store = work / "store"
        train_version(store, seed=0, publish=True)
        # the retrained version, published under load below (trained now: the switch, not the
        # training, is what the window measures)
        retrained = Path(train_version(store, seed=1, publish=False).version_dir).name
        with netns.Network(5, ["ps-a", "ps-b", "worker-c", "worker-d", "serve-e"]) as net:
            a, _, c, _, _ = net.hosts
            roles = Roles(net.hosts, store, work).start()
            try:
                steady = under_load(roles, rate, window, work / "steady.txt", [], [])
                q = window / 4
                ps_down = under_load(roles, rate, window, work / "ps.txt", [lambda: net.cut(a), lambda: net.restore(a)],
                                     [q, 3 * q])  # fmt: skip
                roles.wait(lambda: roles.rejoined(a), 60, "host A SERVING again")
                worker_down = under_load(roles, rate, window, work / "worker.txt",
                                         [lambda: net.cut(c), lambda: net.restore(c)], [q, 3 * q])  # fmt: skip
                roles.wait(lambda: roles.rejoined(c), 60, "host C SERVING again")
                switch = under_load(roles, rate, window, work / "switch.txt",
                                    [lambda: publish(store, "criteo", retrained)], [q])  # fmt: skip
            finally:
                roles.stop()
        one: dict = {"p50_ms": None, "p99_ms": None, "requests": 0}  # quick: no one-host comparison
        if not quick:
            with netns.Network(1, ["one-host"]) as net:
                (work / "one").mkdir()
                roles = Roles(net.hosts * 5, store, work / "one").start()
                try:
                    one = under_load(roles, rate, window, work / "one.txt", [], [])
                finally:
                    roles.stop()
    out |= {
        "failures_host_down": ps_down["failures"],
        "failures_worker_down": worker_down["failures"],
        "mixed_responses": switch["mixed_responses"],
        "failures_switch": switch["failures"],
        "p99_ms_across_hosts": steady["p99_ms"],
        "p99_ms_one_host": one["p99_ms"],
        "p50_ms_across_hosts": steady["p50_ms"],
        "p50_ms_one_host": one["p50_ms"],
        "p99_ms_host_down": ps_down["p99_ms"],
        "max_ms_host_down": ps_down["max_ms"],
        "p99_ms_worker_down": worker_down["p99_ms"],
        "max_ms_worker_down": worker_down["max_ms"],
        "requests": sum(x["requests"] for x in (steady, ps_down, worker_down, switch, one)),
    }
    return out
