"""Run and control a TorchServe on loopback: config, process lifecycle, management API, archiving.

We launch TorchServe's Java frontend directly instead of through the ``torchserve`` script: the
script keeps ONE global pid file (``$TMPDIR/.model_server.pid``), refuses to start a second server
on the machine, and ``torchserve --stop`` terminates whatever that file names. Launching Java
ourselves gives us the exact pid, a pid file in our run dir, and parallel servers in tests.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class TorchServeError(RuntimeError):
    """A TorchServe API call failed; ``status`` is the HTTP code, the message is TorchServe's."""

    def __init__(self, status: int, message: str):
        super().__init__(f"TorchServe returned {status}: {message}")
        self.status = status
        self.message = message


@dataclass
class TorchServeConfig:
    """Everything that goes into TorchServe's config.properties plus how we launch it.

    Batching/worker defaults come from ``loadtest/ts_overhead.py`` on the shared 2-core box: at
    50 rps requests arrive ~20 ms apart, batches never fill, and batching only adds its delay
    (p50 +3 ms at 2 ms, +7 ms at 5 ms); a second worker showed no consistent p99 gain and
    competes with the handler's own compute on 2 cores.
    """

    # Directory TorchServe loads .mar files from (``url=<name>.mar`` in register resolves here).
    model_store: Path
    # Our private directory: config.properties, pid file, logs, key_file.json. Never the cwd.
    run_dir: Path
    # Address of EVERY listener (HTTP inference/management/metrics and both gRPC servers).
    host: str = "127.0.0.1"
    # HTTP inference API port (/ping, /predictions/...).
    inference_port: int = 8080
    # HTTP management API port (register, scale, set-default, unregister).
    management_port: int = 8081
    # Prometheus metrics port (/metrics).
    metrics_port: int = 8082
    # gRPC inference port; TorchServe always starts its gRPC servers, so they need free ports too.
    grpc_inference_port: int = 7070
    # gRPC management port (same reason).
    grpc_management_port: int = 7071
    # Workers a model gets when registered without ``initial_workers``.
    default_workers_per_model: int = 1
    # Default max requests per batch for ``register`` (batch size is per model in TorchServe);
    # the handler still gets a list and must answer one response per request.
    batch_size: int = 1
    # Default time the frontend waits to fill a batch; a lone request waits this long when batch_size > 1.
    max_batch_delay_ms: int = 1
    # Seconds a worker may take on one batch before the frontend kills and restarts it.
    response_timeout_s: int = 30
    # Seconds a worker may take to load a model (import torch, load weights) before it is failed.
    startup_timeout_s: int = 120
    # JVM max heap in MiB; the frontend only queues and copies bytes, it needs little.
    jvm_heap_mb: int = 512
    # Extra JVM options (GC, JIT); appended after the heap option.
    jvm_options: tuple[str, ...] = ()
    # Turn off TorchServe's token auth. Off only on explicit request (e.g. the local demo says so).
    disable_token_auth: bool = False
    # Minutes before the inference/management tokens expire (TorchServe rewrites key_file.json).
    token_expiration_min: float = 60 * 24
    # Allow register/unregister over the management API (``enable_model_api``); it only listens on host.
    enable_model_api: bool = True
    # Netty threads accepting/serving HTTP; 0 = TorchServe default (one per core).
    netty_threads: int = 0
    # Netty threads talking to the Python workers; 0 = TorchServe default (one per core).
    netty_client_threads: int = 0
    # Max queued requests per model before the frontend answers 503; a short queue fails fast.
    job_queue_size: int = 100
    # Log through log4j's async appenders so the request path never waits on a log write.
    async_logging: bool = True
    # "prometheus" serves metrics on the metrics port instead of writing them to log files.
    metrics_mode: str = "prometheus"
    # The system-metrics collector forks a Python process every minute: a latency spike on 2 cores.
    disable_system_metrics: bool = True
    # False: handlers get the raw request bytes (and parse them with orjson) instead of json.loads'd dicts.
    decode_input_request: bool = False
    # Largest request/response body in bytes.
    max_request_size: int = 16 * 1024 * 1024
    # Python interpreter for the backend workers (must have ``ts`` and the handler's imports).
    python: str = sys.executable
    # Frontend log level (org.pytorch.serve). TorchServe's own default is DEBUG: several lines per request.
    log_level: str = "INFO"
    # Extra config.properties entries, written last (they win).
    extra_properties: dict[str, str] = dataclasses.field(default_factory=dict)

    def url(self, port: int) -> str:
        return f"http://{self.host}:{port}"


# TorchServe's bundled log4j2.xml minus the console appender (every line twice) and with the
# frontend at ``log_level`` instead of DEBUG; files land in $LOG_LOCATION (our run dir).
_LOG4J2 = """<?xml version="1.0" encoding="UTF-8"?>
<Configuration>
  <Appenders>
{appenders}
  </Appenders>
  <Loggers>
    <Logger name="ACCESS_LOG" level="info" additivity="false"><AppenderRef ref="access_log"/></Logger>
    <Logger name="MODEL_LOG" level="info" additivity="false"><AppenderRef ref="model_log"/></Logger>
    <Logger name="MODEL_METRICS" level="info" additivity="false"><AppenderRef ref="model_metrics"/></Logger>
    <Logger name="TS_METRICS" level="info" additivity="false"><AppenderRef ref="ts_metrics"/></Logger>
    <Logger name="io.netty" level="error"/>
    <Logger name="org.apache" level="off"/>
    <Logger name="org.pytorch.serve" level="{level}" additivity="false"><AppenderRef ref="ts_log"/></Logger>
    <Root level="info"><AppenderRef ref="ts_log"/></Root>
  </Loggers>
</Configuration>
"""
_APPENDER = """    <RollingFile name="{name}" fileName="${{env:LOG_LOCATION}}/{name}.log"
                 filePattern="${{env:LOG_LOCATION}}/{name}.%i.log.gz">
      <PatternLayout pattern="%d{{ISO8601}} [%-5p] %t %c - %m%n"/>
      <Policies><SizeBasedTriggeringPolicy size="100 MB"/></Policies>
      <DefaultRolloverStrategy max="3"/>
    </RollingFile>"""


def write_log_config(cfg: TorchServeConfig) -> Path:
    """Write ``run_dir/log4j2.xml`` (passed to the JVM with -Dlog4j.configurationFile)."""
    names = ("access_log", "model_log", "model_metrics", "ts_log", "ts_metrics")
    text = _LOG4J2.format(appenders="\n".join(_APPENDER.format(name=n) for n in names), level=cfg.log_level)
    path = Path(cfg.run_dir) / "log4j2.xml"
    path.write_text(text)
    return path


def write_config(cfg: TorchServeConfig) -> Path:
    """Write ``run_dir/config.properties`` and return its path."""
    b = str  # every value is written as text
    props = {
        "inference_address": cfg.url(cfg.inference_port),
        "management_address": cfg.url(cfg.management_port),
        "metrics_address": cfg.url(cfg.metrics_port),
        "grpc_inference_address": cfg.host,
        "grpc_inference_port": b(cfg.grpc_inference_port),
        "grpc_management_address": cfg.host,
        "grpc_management_port": b(cfg.grpc_management_port),
        "model_store": b(Path(cfg.model_store).resolve()),
        # Only archives in our model store may be registered, never a URL someone passes in.
        "allowed_urls": "file://" + b(Path(cfg.model_store).resolve()) + "/.*",
        "default_workers_per_model": b(cfg.default_workers_per_model),
        "default_response_timeout": b(cfg.response_timeout_s),
        "default_startup_timeout": b(cfg.startup_timeout_s),
        "disable_token_authorization": b(cfg.disable_token_auth).lower(),
        "token_expiration_min": b(cfg.token_expiration_min),
        "enable_model_api": b(cfg.enable_model_api).lower(),
        "job_queue_size": b(cfg.job_queue_size),
        "async_logging": b(cfg.async_logging).lower(),
        "metrics_mode": cfg.metrics_mode,
        "disable_system_metrics": b(cfg.disable_system_metrics).lower(),
        "decode_input_request": b(cfg.decode_input_request).lower(),
        "max_request_size": b(cfg.max_request_size),
        "max_response_size": b(cfg.max_request_size),
        "enable_envvars_config": "false",  # TS_* variables in our env must not override this file
        "install_py_dep_per_model": "false",
    }
    if cfg.netty_threads:
        props["number_of_netty_threads"] = b(cfg.netty_threads)
    if cfg.netty_client_threads:
        props["netty_client_threads"] = b(cfg.netty_client_threads)
    props.update(cfg.extra_properties)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.properties"
    path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
    return path


# Loopback calls must never go through an http_proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http(
    method: str, url: str, token: str | None, body: bytes | None = None, content_type: str = ""
) -> bytes:
    req = urllib.request.Request(url, data=body, method=method)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if content_type:
        req.add_header("Content-Type", content_type)
    try:
        with _OPENER.open(req, timeout=300) as resp:
            return resp.read()
    except urllib.error.HTTPError as e:
        raw = e.read().decode("utf-8", "replace")
        try:
            message = json.loads(raw).get("message", raw)
        except (ValueError, AttributeError):
            message = raw
        raise TorchServeError(e.code, message.strip()) from None


class _Keys:
    """Reads TorchServe's key_file.json ({"management": {"key"}, "inference": {"key"}, "API": {...}})."""

    def __init__(self, key_file: Path | None):
        self.key_file = key_file

    def get(self, kind: str) -> str | None:
        if self.key_file is None:
            return None
        return json.loads(self.key_file.read_text())[kind]["key"]


class ManagementClient:
    """The TorchServe management API (stdlib HTTP). ``key_file`` is None when token auth is off."""

    def __init__(self, base_url: str, key_file: Path | None = None, defaults: TorchServeConfig | None = None):
        self.base_url = base_url.rstrip("/")
        self._keys = _Keys(key_file)
        self._defaults = defaults

    def _call(self, method: str, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode({k: v for k, v in params.items() if v is not None})
        url = f"{self.base_url}{path}" + (f"?{query}" if query else "")
        raw = _http(method, url, self._keys.get("management"))
        return json.loads(raw) if raw else None

    def register(
        self,
        mar_name: str,
        model_name: str,
        initial_workers: int | None = None,
        batch_size: int | None = None,
        max_batch_delay_ms: int | None = None,
        synchronous: bool = True,
    ) -> dict:
        """Load ``mar_name`` (a file in the model store) as ``model_name``; its version comes from the .mar."""
        d = self._defaults

        def pick(value: int | None, field: str) -> int | None:  # explicit arg, else our config's default
            return value if value is not None or d is None else getattr(d, field)

        return self._call(
            "POST",
            "/models",
            url=mar_name,
            model_name=model_name,
            initial_workers=pick(initial_workers, "default_workers_per_model"),
            batch_size=pick(batch_size, "batch_size"),
            max_batch_delay=pick(max_batch_delay_ms, "max_batch_delay_ms"),
            response_timeout=pick(None, "response_timeout_s"),
            synchronous=str(synchronous).lower(),
        )

    def scale(self, model: str, version: str, min_workers: int, synchronous: bool = True) -> dict:
        return self._call(
            "PUT", f"/models/{model}/{version}", min_worker=min_workers, synchronous=str(synchronous).lower()
        )

    def rotate_key(self, kind: str = "inference") -> None:
        """Make TorchServe issue a new ``kind`` ("inference" or "management") key into key_file.json.

        Keys expire after ``token_expiration_min``; the key file's "API" key authorises this call.
        """
        _http("PUT", f"{self.base_url}/token?type={kind}", self._keys.get("API"))

    def set_default(self, model: str, version: str) -> dict:
        return self._call("PUT", f"/models/{model}/{version}/set-default")

    def unregister(self, model: str, version: str, synchronous: bool = True) -> dict:
        return self._call("DELETE", f"/models/{model}/{version}", synchronous=str(synchronous).lower())

    def list_models(self) -> list[dict]:
        """All registered models (following TorchServe's pagination)."""
        models: list[dict] = []
        token = None
        while True:
            page = self._call("GET", "/models", limit=100, next_page_token=token)
            models.extend(page.get("models", []))
            token = page.get("nextPageToken")
            if not token:
                return models

    def describe(self, model: str, version: str | None = None) -> list[dict]:
        """Per-version details (workers, batch settings, default flag); version "all" lists all."""
        return self._call("GET", f"/models/{model}" + (f"/{version}" if version else ""))


class InferenceClient:
    """Minimal inference API client (stdlib HTTP); for tests and tools, not for load generation."""

    def __init__(self, base_url: str, key_file: Path | None = None):
        self.base_url = base_url.rstrip("/")
        self._keys = _Keys(key_file)

    def ping(self) -> dict:
        # With token auth on, every inference-port request needs the inference key, /ping included.
        return json.loads(_http("GET", f"{self.base_url}/ping", self._keys.get("inference")))

    def predict(
        self, model: str, body: bytes, version: str | None = None, content_type: str = "application/json"
    ) -> bytes:
        path = f"/predictions/{model}" + (f"/{version}" if version else "")
        return _http("POST", self.base_url + path, self._keys.get("inference"), body, content_type)

    def inference_token(self) -> str | None:
        return self._keys.get("inference")


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
        self._stdout = None

    def command(self, config_path: Path) -> list[str]:
        java_home = os.environ.get("JAVA_HOME")
        java = str(Path(java_home) / "bin" / "java") if java_home else (shutil.which("java") or "java")
        ts_home = _ts_home()
        return [
            java,
            f"-Dmodel_server_home={ts_home}",
            f"-Xmx{self.cfg.jvm_heap_mb}m",
            f"-Djava.io.tmpdir={self.run_dir / 'tmp'}",
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
        (self.run_dir / "tmp").mkdir(parents=True, exist_ok=True)
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
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
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


def _ts_home() -> str:
    import ts  # the installed torchserve package; its parent dir is TorchServe's "model_server_home"

    return str(Path(ts.__file__).resolve().parent.parent)


def archive(
    handler_py: str | Path,
    extra_files: list[str | Path] | tuple[str | Path, ...],
    model_name: str,
    version: str,
    export_dir: str | Path,
    serialized_file: str | Path | None = None,
) -> Path:
    """Build ``export_dir/<model_name>-<version>.mar`` with torch-model-archiver and return its path.

    The archiver always names its output ``<model_name>.mar``; we build in a temp dir and rename,
    so several versions of one model can sit side by side in the model store.
    """
    from model_archiver.model_archiver_config import ModelArchiverConfig
    from model_archiver.model_packaging import package_model
    from model_archiver.model_packaging_utils import ModelExportUtils

    export_dir = Path(export_dir)
    export_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=export_dir, prefix=".archive-") as tmp:
        config = ModelArchiverConfig(
            model_name=model_name,
            handler=str(Path(handler_py).resolve()),
            version=version,
            serialized_file=str(Path(serialized_file).resolve()) if serialized_file else None,
            extra_files=",".join(str(Path(f).resolve()) for f in extra_files) or None,
            export_path=tmp,
            force=True,
        )
        package_model(config, manifest=ModelExportUtils.generate_manifest_json(config))
        target = export_dir / f"{model_name}-{version}.mar"
        os.replace(Path(tmp) / f"{model_name}.mar", target)  # atomic: TorchServe never sees half a file
    return target
