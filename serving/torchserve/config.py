"""TorchServe's config.properties and log config, from one typed dataclass."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path


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
    # JVM heap in MiB, sized and touched at start (-Xms = -Xmx, AlwaysPreTouch): the frontend only
    # queues and copies bytes, it needs little, and a heap left to grow stepped the soak's RSS at
    # every dense switch (committed 45 -> 82 MB in a one-minute run, -XX:NativeMemoryTracking).
    jvm_heap_mb: int = 256
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
    if cfg.metrics_mode == "prometheus" and "metrics_config" not in props:
        from serving.torchserve.metrics import write_metrics_config

        props["metrics_config"] = b(write_metrics_config(run_dir / "metrics.yaml").resolve())
    path = run_dir / "config.properties"
    path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
    return path


def niced_python(path: Path) -> Path:
    """A script at ``path`` that runs this Python at nice 10, for TorchServe's Python workers: a
    version loading beside the serving one (imports, warm-up) yields the CPU to it; the handler
    returns to niceness 0 once loaded (``serving.priority.loading_priority``)."""
    path.write_text(f'#!/bin/sh\nexec nice -n 10 "{sys.executable}" "$@"\n')
    path.chmod(0o755)
    return path
