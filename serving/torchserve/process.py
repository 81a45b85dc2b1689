"""Run and control a TorchServe on loopback: config, process lifecycle, management API, archiving.

We launch TorchServe's Java frontend directly instead of through the ``torchserve`` script: the
script keeps ONE global pid file (``$TMPDIR/.model_server.pid``), refuses to start a second server
on the machine, and ``torchserve --stop`` terminates whatever that file names. Launching Java
ourselves gives us the exact pid, a pid file in our run dir, and parallel servers in tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import BinaryIO

from serving.rpc.procs import terminate
from serving.torchserve.api import InferenceClient, ManagementClient, TorchServeError
from serving.torchserve.archive import _ts_home
from serving.torchserve.config import TorchServeConfig, write_config, write_log_config

_MAX_UNIX_PATH = 100


class TorchServe:
    """One TorchServe process we started and own. Use as ``with TorchServe(cfg) as ts: ...``."""

    def __init__(self, cfg: TorchServeConfig):
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir).resolve()
        self.pid_file = self.run_dir / "torchserve.pid"
        self.log_dir = self.run_dir / "logs"
        # TorchServe writes key_file.json to the JVM's working directory, which we set to run_dir.
        self.key_file = self.run_dir / "key_file.json"
        self._proc: subprocess.Popen | None = None
        self._stdout: BinaryIO | None = None
        # Python workers listen on <java.io.tmpdir>/.ts.sock.<port>: an AF_UNIX path, at most 107
        # bytes. A deep run dir (a long store path) gets a short private dir under /tmp instead,
        # or every worker dies at bind and TorchServe only says UNLOADING.
        self.tmp_dir = self.run_dir / "tmp"
        if len(str(self.tmp_dir / ".ts.sock.65535")) > _MAX_UNIX_PATH:
            self.tmp_dir = Path(tempfile.mkdtemp(prefix="recserve-ts-"))

    def command(self, config_path: Path) -> list[str]:
        java_home = os.environ.get("JAVA_HOME")
        java = str(Path(java_home) / "bin" / "java") if java_home else (shutil.which("java") or "java")
        ts_home = _ts_home()
        return [
            java,
            f"-Dmodel_server_home={ts_home}",
            f"-Xms{self.cfg.jvm_heap_mb}m",
            f"-Xmx{self.cfg.jvm_heap_mb}m",
            "-XX:+AlwaysPreTouch",  # the heap resident from the start: RSS does not step as it grows
            f"-Djava.io.tmpdir={self.tmp_dir}",
            "-Djava.net.preferIPv4Stack=true",  # plain IPv4 sockets, not ::ffff:127.0.0.1 dual-stack
            f"-Dlog4j.configurationFile=file://{self.run_dir / 'log4j2.xml'}",
            *self.cfg.jvm_options,
            "-cp",
            str(Path(ts_home) / "ts" / "frontend" / "*"),
            "org.pytorch.serve.ModelServer",
            "--python",
            self.cfg.python,
            "-f",
            str(config_path),
            "-s",
            str(Path(self.cfg.model_store).resolve()),
            "-ncs",  # no config snapshots: a restart must not resurrect models from an old run
        ]

    def start(self) -> TorchServe:
        if self._proc is not None:
            raise RuntimeError("this TorchServe is already started")
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.key_file.unlink(missing_ok=True)  # a stale key file would hand out dead tokens
        config_path = write_config(self.cfg)
        write_log_config(self.cfg)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TS_")}
        env.update(LOG_LOCATION=str(self.log_dir), METRICS_LOCATION=str(self.log_dir))
        self._stdout = open(self.log_dir / "stdout.log", "wb")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            self.command(config_path),
            cwd=self.run_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._stdout,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: stop() can reach its Python workers too
        )
        self.pid_file.write_text(f"{self._proc.pid}\n")
        return self

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def wait_healthy(self, timeout: float = 60.0) -> float:
        """Block until startup is complete and GET /ping says Healthy; returns seconds waited.

        /ping answers as soon as the HTTP servers are up, before the gRPC servers bind; the JVM
        prints "Model server started." on stdout only after all listeners are up.
        """
        t0 = time.monotonic()
        client = self.inference()
        while True:
            if not self.running():
                raise RuntimeError(
                    f"TorchServe exited during startup; see {self.log_dir}:\n{self.log_tail()}"
                )
            try:
                if self._started() and client.ping().get("status") == "Healthy":
                    return time.monotonic() - t0
            except (OSError, TorchServeError, ValueError, KeyError):
                pass
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"TorchServe not healthy after {timeout}s:\n{self.log_tail()}")
            time.sleep(0.05)

    def _started(self) -> bool:
        started = b"Model server started." in (self.log_dir / "stdout.log").read_bytes()
        return started and (self.cfg.disable_token_auth or self.key_file.exists())

    def log_tail(self, lines: int = 30) -> str:
        for name in ("ts_log.log", "stdout.log"):
            path = self.log_dir / name
            if path.exists():
                return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM our JVM (its shutdown hook stops the workers), wait; SIGKILL our process group if stuck."""
        proc, self._proc = self._proc, None
        if proc is not None:
            pgid = proc.pid  # start_new_session: the group id is the JVM's pid
            terminate(proc, timeout)
            try:  # Python workers that outlived the JVM belong to our group and nobody else's
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._stdout is not None:
            self._stdout.close()
            self._stdout = None
        self.pid_file.unlink(missing_ok=True)
        self.key_file.unlink(missing_ok=True)  # as ``torchserve --stop`` does: dead keys help nobody

    def management(self) -> ManagementClient:
        key = None if self.cfg.disable_token_auth else self.key_file
        return ManagementClient(self.cfg.url(self.cfg.management_port), key, defaults=self.cfg)

    def inference(self) -> InferenceClient:
        key = None if self.cfg.disable_token_auth else self.key_file
        return InferenceClient(self.cfg.url(self.cfg.inference_port), key)

    def __enter__(self) -> TorchServe:
        if self._proc is None:
            self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
