"""``recserve up`` / ``down`` / ``score``: the local serving stack and a client for it."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

from recserve.config import store_field
from serving.stack.local import StackConfig


def run_up(cfg: StackConfig) -> int:
    from model_store import ModelStoreError
    from serving.stack.local import LocalStack

    try:
        stack = LocalStack(cfg).start()
    except (ModelStoreError, RuntimeError, TimeoutError, ValueError) as e:
        print(f"recserve up: {e}", file=sys.stderr)
        return 1
    s = stack.state
    replicas = len(s.ps) // len(s.ps_shards)
    print(
        f"serving {s.model} version {s.version}: {len(s.ps_shards)} PS shard(s) x {replicas} replica(s) "
        f"{', '.join(s.ps)}, worker {s.worker}"
    )
    for shard in s.shards:
        print(f"  ps shard {shard.shard} ({shard.address}): version {shard.version}, "
              f"delta {shard.delta_seq}, {shard.rows} rows")  # fmt: skip
    metrics = ", ".join(
        f"{name} http://{address}/metrics" for name, address in sorted(s.metrics_endpoints.items())
    )
    print(f"metrics: {metrics}\n  (Prometheus targets: {stack.run_dir / 'prometheus-targets.json'})")
    if not s.endpoint:
        print(
            f"no TorchServe (--no-torchserve): score with recserve serve --lookups remote --worker {s.worker}"
        )
    elif s.token_auth:
        print(f"endpoint: POST {s.endpoint}\ntoken auth is ON: send 'Authorization: Bearer <inference key>' "
              f"from {s.key_file}")  # fmt: skip
    else:
        print(f"endpoint: POST {s.endpoint}")
        print("token auth is OFF (--no-token-auth): anyone on this host can call the APIs")
    if s.tls:
        client = s.tls["client"]
        mtls = f"; clients must present {client['cert']} (mTLS)" if client["cert"] else ""
        print(f"TLS is ON for the PS shards and the worker: CA {client['ca']}{mtls}")
    else:
        print("gRPC (PS shards, worker) is plaintext on loopback (--tls turns TLS on)")
    if "supervisor" in s.pids:
        print(f"supervised: a process that dies is restarted (see {stack.run_dir}/logs/supervisor.log)")
    print(f"stop with: recserve down --run-dir {stack.run_dir}")
    return 0


@dataclass
class DownConfig:
    """``recserve down``: stop exactly what a previous ``recserve up`` started."""

    store: str = store_field()
    """Model-store root (with --model, finds the default run dir)."""
    model: str = ""
    """Model name (finds <store>/.run/<model>)."""
    run_dir: str = ""
    """The run dir `recserve up` printed."""

    def __post_init__(self) -> None:
        if not self.run_dir and not self.model:
            raise ValueError("give --run-dir or --model")


def run_down(cfg: DownConfig) -> int:
    from serving.stack.down import down
    from serving.stack.local import default_run_dir

    run_dir = Path(cfg.run_dir or default_run_dir(cfg.store, cfg.model))
    stopped = down(run_dir)
    print(f"stopped {', '.join(stopped)}" if stopped else f"nothing running from {run_dir}")
    return 0


@dataclass
class ScoreConfig:
    """``recserve score``: send requests built from a data file and print the scores."""

    file: str = field(default="", metadata={"positional": True})
    """Criteo TSV/CSV rows, or a JSON file with one request or a list of requests."""
    url: str = "http://127.0.0.1:8080/predictions/criteo"
    """Scoring endpoint."""
    schema: str = "data/schemas/criteo.yaml"
    """Feature schema for data files (and binary batches)."""
    rows: int = 200
    """Rows per request for data files."""
    limit: int | None = None
    """Score at most this many rows."""
    key_file: str = ""
    """TorchServe key_file.json when token auth is on."""
    binary: bool = False
    """Send compact batches instead of JSON."""
    ca: str = ""
    """For an https:// URL: the CA that signed the endpoint's certificate (PEM; default: the system's CAs)."""

    def __post_init__(self) -> None:
        if not self.file:
            raise ValueError("give the FILE to score")


def run_score(cfg: ScoreConfig) -> int:
    import orjson

    from serving.scoring.client import ScoringClient, requests_from_file

    try:
        client = ScoringClient(cfg.url, key_file=cfg.key_file or None, ca=cfg.ca)
    except (ValueError, OSError) as e:  # not http(s), a CA or key file that cannot be read
        print(f"recserve score: {e}", file=sys.stderr)
        return 2
    n = 0
    for body, ctype in requests_from_file(cfg.file, cfg.schema, cfg.rows, cfg.limit, cfg.binary):
        try:
            status, payload = client.post(body, ctype)
        except OSError as e:  # refused, timed out, a certificate the CA did not sign
            print(f"recserve score: {cfg.url}: {e}", file=sys.stderr)
            return 1
        reply = orjson.loads(payload)
        if status != 200:
            print(f"request {n}: HTTP {status}: {reply.get('error')}", file=sys.stderr)
            return 1
        scores = reply["scores"]
        head = ", ".join(f"{s:.4f}" for s in scores[:5])
        print(
            f"request {n}: {len(scores)} scores [{head}{', ...' if len(scores) > 5 else ''}] versions {json.dumps(reply['versions'])}"
        )
        n += 1
    return 0


COMMANDS = {
    "up": types.SimpleNamespace(CONFIG=StackConfig, run=run_up),
    "down": types.SimpleNamespace(CONFIG=DownConfig, run=run_down),
    "score": types.SimpleNamespace(CONFIG=ScoreConfig, run=run_score),
}
