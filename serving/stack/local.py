"""The local serving stack: PS shards + embedding worker + TorchServe with the scoring handler.

``LocalStack(StackConfig).start()`` loads the served version (``CURRENT`` or a given one, checked
against its manifest), starts ``replicas`` ``recserve ps-serve`` processes per shard loading that
version's embeddings, waits until every one serves that version, starts a ``recserve worker`` over
them (a shard's replicas in one ``--ps`` entry, ``serving.worker.replicas``) and TorchServe with the
model registered, waits until every part is healthy, writes ``<run_dir>/stack.json`` (pids, ports,
endpoint, the command of each process) and starts the controller and the supervisor
(``serving.stack.supervisor``: restarts any process that dies). With ``--no-torchserve`` neither
TorchServe nor the controller: the PS shards and the worker alone, for ``recserve serve`` in front. ``stop()`` -- or ``recserve
down``, from another process -- stops the supervisor first, then exactly the processes listed
there. Never serve nothing: a shard that refuses the version (or has not
loaded it after ``startup_timeout_s``) fails ``start`` with every shard's reason, after stopping
what it started.

TLS (``--tls``, ``serving.stack.tls``): fresh certificates under ``<run_dir>/tls``; every PS shard
and the worker serve over TLS (mTLS unless ``--no-tls-client-auth``) and every client presents them.

TorchServe: every listener on 127.0.0.1; the model-control API is on the loopback management port
only; token auth stays ON unless ``disable_token_auth`` is set (the local demo sets it, and says so).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import model_store
from serving.rpc.procs import free_ports, spawn, start_time, stop_children, stop_pid, wait_grpc_healthy
from serving.stack import tls as stack_tls
from serving.stack.config import StackConfig
from serving.stack.dense import DenseSwitch
from serving.stack.down import any_alive, down
from serving.stack.metrics import write_prometheus_targets
from serving.stack.packaging import torchserve_config
from serving.stack.state import (
    Command,
    ServedShard,
    StackState,
    read_state,
    remove_state,
    state_exists,
    update_state,
    write_state,
)

if TYPE_CHECKING:
    from serving.torchserve import TorchServe

__all__ = ["LocalStack", "StackConfig", "default_run_dir"]


class LocalStack:
    """Starts, health-checks and stops the stack's processes; its state is ``state`` (stack.json),
    its dense versions are switched by ``dense`` (``serving.stack.dense``)."""

    def __init__(self, config: StackConfig):
        self.config = config
        self.root = Path(config.store).resolve()
        self.run_dir = Path(config.run_dir or default_run_dir(config.store, config.model)).resolve()
        self.state = StackState(model=config.model, version="", run_dir=str(self.run_dir), config=config)
        self._procs: dict = {}
        self._ts: TorchServe | None = None

    @property
    def dense(self) -> DenseSwitch:
        return DenseSwitch(self.config, self.state, self.run_dir)

    # --- start ----------------------------------------------------------------------------------
    def start(self) -> LocalStack:
        cfg = self.config
        if state_exists(self.run_dir) and any_alive(read_state(self.run_dir)):
            raise RuntimeError(f"a stack is already running from {self.run_dir}; run `recserve down` first")
        current = model_store.current(self.root, cfg.model)
        version = cfg.version or current
        if version is None:
            raise RuntimeError(f"{self.root}/{cfg.model}: no CURRENT version; train and publish one first")
        pin = "" if version == current else version  # a --version that is not CURRENT is never switched
        vdir = model_store.version_dir(self.root, cfg.model, version)
        manifest = model_store.read_manifest(vdir)  # refuses incomplete or corrupt versions
        n = cfg.ps_shards or manifest.num_shards  # PS shards re-shard the dump by the routing hash
        ps_ports = list(cfg.ps_ports) or free_ports(n * cfg.replicas, cfg.host)
        if len(ps_ports) != n * cfg.replicas:
            raise ValueError(
                f"serving {n} PS shards x {cfg.replicas} replicas; {len(ps_ports)} PS ports given"
            )
        worker_port = cfg.worker_port or free_ports(1, cfg.host)[0]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        logs = self.run_dir / "logs"
        self.state = StackState(
            model=cfg.model, version=version, run_dir=str(self.run_dir), config=cfg, pin=pin
        )
        if cfg.tls:
            self.state.tls = stack_tls.create(self.run_dir / "tls", cfg.host, cfg.tls_client_auth)
        try:
            self._start_ps(vdir, manifest, ps_ports, logs)
            self._start_worker(vdir, ps_ports, worker_port, logs)
            if cfg.torchserve:  # and its controller; else the PS shards and the worker alone
                self._start_torchserve(vdir, version, worker_port)
                self._write_state()
                port = self._metrics_port("controller")
                self._spawn("controller", ["controller", "--run-dir", str(self.run_dir), "--poll-s", str(cfg.poll_s),
                                           "--metrics-port", str(port)], logs / "controller.log")  # fmt: skip
            write_prometheus_targets(self.run_dir, self.state)
            self._write_state()
            if cfg.supervise:  # last: it restarts what it finds dead in stack.json
                self._start_supervisor(logs)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, args: list[str], log: Path) -> None:
        """Start ``recserve <args>`` as ``name``; its pid and command go into the state (the
        supervisor restarts it with the same command)."""
        self._procs[name] = spawn(args, log)
        self.state.pids[name] = self._procs[name].pid
        self.state.commands[name] = Command(args, str(log))

    def _start_supervisor(self, logs: Path) -> None:
        proc = self._procs["supervisor"] = spawn(["supervisor", "--run-dir", str(self.run_dir)],
                                                 logs / "supervisor.log")  # fmt: skip
        began = start_time(proc.pid)
        self.state.pids["supervisor"] = proc.pid
        self.state.started_at["supervisor"] = began

        def add(state: StackState) -> None:
            state.pids["supervisor"], state.started_at["supervisor"] = proc.pid, began

        update_state(self.run_dir, add)

    def _start_ps(
        self, vdir: Path, manifest: model_store.VersionManifest, ports: list[int], logs: Path
    ) -> None:
        cfg, r = self.config, self.config.replicas
        n = len(ports) // r
        shards = [[f"{cfg.host}:{p}" for p in ports[i * r : (i + 1) * r]] for i in range(n)]
        self._ps_names: dict[str, tuple[str, str]] = {}  # address -> (process name, label)
        for i, replicas in enumerate(shards):
            for k, address in enumerate(replicas):
                # following the model: serve CURRENT, switch with it, apply its deltas; a pinned
                # --version that is not CURRENT is served with its deltas and never switched
                source = [str(vdir.parent), "--poll-s", str(cfg.poll_s)]
                if self.state.pin:
                    source += ["--pin", vdir.name]
                name, label = (
                    (f"ps{i}", f"ps shard {i}") if r == 1 else (f"ps{i}.{k}", f"ps shard {i} replica {k}")
                )
                args = ["ps-serve", "--shard", str(i), "--num-shards", str(n), "--host", cfg.host,
                        "--port", address.rsplit(":", 1)[1], "--dim", str(manifest.dim), *source,
                        "--dtype", cfg.dtype, "--metrics-port", str(self._metrics_port(name)),
                        *stack_tls.server_flags(self.state)]  # fmt: skip
                self._spawn(name, args, logs / f"{name}.log")
                self._ps_names[address] = (name, label)
        self.state.ps = [a for replicas in shards for a in replicas]
        self.state.ps_shards = shards
        self.state.shards = self._wait_shards_serve(vdir.name, logs)

    def _wait_shards_serve(self, version: str, logs: Path) -> list[ServedShard]:
        """Poll every PS shard's Stats until each serves ``version`` (a pinned version is served
        once the shard answers: it loaded the dump before listening). Fails as soon as every shard
        has either served it, refused it or exited, with one that did not; or after
        ``startup_timeout_s``: the error names every shard not serving and why. Returns what each
        one serves."""
        from serving.ps.client import PSClient

        cfg = self.config
        clients = [PSClient(a, timeout_s=2.0, tls=stack_tls.client(self.state)) for a in self.state.ps]
        deadline = time.monotonic() + cfg.startup_timeout_s
        try:
            while True:
                states = [self._shard_state(c, version, logs) for c in clients]
                missing = {i: why for i, (_, why, _) in enumerate(states) if why}
                if not missing:  # no reason given: every shard serves
                    served = [s for s, _, _ in states if s is not None]
                    if len(served) != len(states):
                        raise AssertionError("a PS shard gave no reason yet no served state")
                    return served
                fatal = all(final for _, why, final in states if why)  # each shard has decided
                if fatal or time.monotonic() > deadline:
                    label = lambda c: self._ps_names[c.target][1]  # noqa: E731
                    why = "".join(
                        f"\n  {label(clients[i])} ({clients[i].target}): {m}" for i, m in missing.items()
                    )
                    head = f"{cfg.model} version {version} is not served by every PS shard"
                    if fatal:
                        raise RuntimeError(f"{head}:{why}")
                    raise TimeoutError(f"{head} after {cfg.startup_timeout_s}s:{why}")
                time.sleep(0.1)
        finally:
            for client in clients:
                client.close()

    def _shard_state(self, client, version: str, logs: Path) -> tuple[ServedShard | None, str, bool]:
        """(what the PS at ``client`` serves, or None; why it does not serve ``version``; whether
        that is final)."""
        from serving.ps.client import ShardError

        name = self._ps_names[client.target][0]
        proc = self._procs[name]
        if proc.poll() is not None:
            tail = (logs / f"{name}.log").read_text(errors="replace")[-1500:].strip()
            return None, f"exited with {proc.returncode}:\n{tail}", True
        try:
            st = client.stats()
        except ShardError as e:
            return None, f"not answering yet ({e.code or e})", False
        if st["refusal"]:
            return None, st["refusal"], True
        if not self.state.pin and st["version"] != version:
            return None, f"serves version {st['version'] or '(none yet)'}", False
        return (
            ServedShard(client.target, st["shard"], st["version"] or version, st["delta_seq"], st["rows"]),
            "",
            False,
        )

    def _start_worker(self, vdir: Path, ps_ports: list[int], port: int, logs: Path) -> None:
        cfg = self.config
        from serving.worker.replicas import format_ps_spec

        args = ["worker", "--ps", format_ps_spec(self.state.ps_shards), "--schema", str(vdir / "schema.yaml"),
                "--host", cfg.host, "--port", str(port), "--metrics-port", str(self._metrics_port("worker")),
                *stack_tls.server_flags(self.state, worker=True)]  # fmt: skip
        self._spawn("worker", args, logs / "worker.log")
        wait_grpc_healthy(
            f"{cfg.host}:{port}", cfg.startup_timeout_s, self._procs["worker"], logs / "worker.log",
            stack_tls.client(self.state),
        )  # fmt: skip
        self.state.worker = f"{cfg.host}:{port}"

    def _start_torchserve(self, vdir: Path, version: str, worker_port: int) -> None:
        from serving.torchserve import TorchServe

        cfg = self.config
        ports = [
            p or q
            for p, q in zip(
                (cfg.http_port, cfg.management_port, cfg.metrics_port), free_ports(3, cfg.host), strict=True
            )
        ]
        ports += free_ports(2, cfg.host)  # TorchServe's gRPC servers (unused, but always started)
        s = self.state
        s.torchserve_ports = ports  # a restart (the supervisor) takes the same ones
        ts_cfg = torchserve_config(cfg, s, self.run_dir)
        self._ts = TorchServe(ts_cfg).start()
        if self._ts.pid is None:
            raise RuntimeError("TorchServe started but has no process id")
        s.pids["torchserve"] = self._ts.pid
        self._ts.wait_healthy(cfg.startup_timeout_s)
        s.endpoint = f"http://{cfg.host}:{ports[0]}/predictions/{cfg.model}"
        s.inference, s.management, s.metrics = (ts_cfg.url(p) for p in ports[:3])
        s.metrics_endpoints["torchserve"] = f"{cfg.host}:{ports[2]}"
        s.token_auth = not cfg.disable_token_auth
        s.key_file = None if cfg.disable_token_auth else str(self._ts.key_file)
        self.dense.register(vdir, version, make_default=True)

    def restart_torchserve(self):
        """Start TorchServe again (it died) on its old ports and register the dense version the
        stack served, as its default; for the supervisor, on a stack from ``attach``. Returns the
        ``TorchServe`` (whose process the caller owns). Token auth: new keys, in the same key file."""
        from serving.torchserve import TorchServe

        self._ts = TorchServe(torchserve_config(self.config, self.state, self.run_dir)).start()
        try:
            self._ts.wait_healthy(self.config.startup_timeout_s)
            version = self.state.dense_version
            vdir = model_store.version_dir(self.root, self.config.model, version)
            self.dense.register(vdir, version, make_default=True)
        except BaseException:
            self._ts.stop()  # no half-started server holding the ports for the next try
            raise
        return self._ts

    # --- metrics ----------------------------------------------------------------------------------
    def _metrics_port(self, name: str) -> int:
        """A free port for process ``name``'s /metrics, recorded in the state (``metrics_endpoints``)."""
        host = self.config.host
        port = free_ports(1, host)[0]
        self.state.metrics_endpoints[name] = f"{host}:{port}"
        return port

    # --- stop -----------------------------------------------------------------------------------
    def stop(self) -> None:
        # the supervisor first (it would restart what is stopped), then the controller (it must not
        # act on a half-stopped stack), then -- from stack.json -- the replacements the supervisor
        # started; then what this object started itself (reaped)
        for first in ("supervisor", "controller"):
            proc = self._procs.pop(first, None)
            if proc is not None:
                stop_pid(proc.pid, "recserve")
                proc.wait(10)
        down(self.run_dir)
        if self._ts is not None:
            self._ts.stop()
            self._ts = None
        stop_children(list(self._procs.values()))
        self._procs.clear()
        remove_state(self.run_dir)

    def _write_state(self) -> None:
        self.state.started_at = {name: start_time(pid) for name, pid in self.state.pids.items()}
        self.state.started = time.time()
        write_state(self.run_dir, self.state)

    def save_state(self, *names: str) -> None:
        """Write the fields ``names`` of this object's state into stack.json as they are now (the
        controller and the supervisor each write their own fields of a running stack)."""
        if not names:
            raise ValueError("name the state fields to save")
        values = {name: getattr(self.state, name) for name in names}

        def change(state: StackState) -> None:
            for name, value in values.items():
                setattr(state, name, value)

        update_state(self.run_dir, change)

    @classmethod
    def attach(cls, run_dir: str | Path) -> LocalStack:
        """A handle on a running stack (from its stack.json) that owns none of its processes."""
        state = read_state(run_dir)
        stack = cls(state.config)
        stack.run_dir = Path(run_dir).resolve()
        stack.state = state
        return stack

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def default_run_dir(store: str | Path, model: str) -> Path:
    """Where ``recserve up`` keeps a model's stack (stack.json, logs) unless given ``--run-dir``."""
    return Path(store).resolve() / ".run" / model
