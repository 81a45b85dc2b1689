"""``recserve up`` / ``recserve down`` / ``recserve score``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_up_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-store", default="model_store", help="model store root (default model_store)")
    p.add_argument("--model", required=True, help="model name in the store")
    p.add_argument("--version", help="version to serve (default: the one named by CURRENT)")
    p.add_argument("--run-dir", help="pid files, logs and configs (default <model-store>/.run/<model>)")
    p.add_argument("--host", default="127.0.0.1", help="interface every listener binds (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=8080, help="TorchServe inference port (0: any free)")
    p.add_argument(
        "--management-port", type=int, default=8081, help="TorchServe management port, loopback (0: any free)"
    )
    p.add_argument("--metrics-port", type=int, default=8082, help="TorchServe metrics port (0: any free)")
    p.add_argument(
        "--worker-port", type=int, default=0, help="embedding worker gRPC port (default: any free)"
    )
    p.add_argument("--runtime", choices=["torchscript", "onnx"], default="torchscript", help="dense runtime")
    p.add_argument("--ts-workers", type=int, default=1, help="TorchServe handler processes (default 1)")
    p.add_argument(
        "--no-token-auth", action="store_true", help="turn TorchServe token auth OFF (it is on by default)"
    )


def run_up(args: argparse.Namespace) -> int:
    from serving.stack import LocalStack, StackConfig

    cfg = StackConfig(
        model_store=args.model_store, model=args.model, version=args.version, run_dir=args.run_dir,
        host=args.host, http_port=args.http_port, management_port=args.management_port,
        metrics_port=args.metrics_port, worker_port=args.worker_port, ps_shards=args.ps_shards, runtime=args.runtime,
        ts_workers=args.ts_workers, disable_token_auth=args.no_token_auth,
    )  # fmt: skip
    from serving.model_store import ModelStoreError

    try:
        stack = LocalStack(cfg).start()
    except (ModelStoreError, RuntimeError, TimeoutError, ValueError) as e:
        print(f"recserve up: {e}", file=sys.stderr)
        return 1
    s = stack.state
    print(
        f"serving {s['model']} version {s['version']}: {len(s['ps'])} PS shard(s) {', '.join(s['ps'])}, worker {s['worker']}"
    )
    print(f"endpoint: POST {s['endpoint']}")
    if s["token_auth"]:
        print(f"token auth is ON: send 'Authorization: Bearer <inference key>' from {s['key_file']}")
    else:
        print("token auth is OFF (--no-token-auth): anyone on this host can call the APIs")
    print(f"stop with: recserve down --run-dir {stack.run_dir}")
    return 0


def add_down_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-store", default="model_store", help="model store root (default model_store)")
    p.add_argument("--model", help="model name (with --model-store, finds the default run dir)")
    p.add_argument("--run-dir", help="the run dir `recserve up` printed")


def run_down(args: argparse.Namespace) -> int:
    from serving.stack import down

    if not args.run_dir and not args.model:
        print("recserve down: give --run-dir or --model", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir or Path(args.model_store).resolve() / ".run" / args.model)
    stopped = down(run_dir)
    print(f"stopped {', '.join(stopped)}" if stopped else f"nothing running from {run_dir}")
    return 0


def add_score_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="Criteo TSV/CSV rows, or a JSON file with one request or a list of requests")
    p.add_argument(
        "--url", required=True, help="scoring endpoint, e.g. http://127.0.0.1:8080/predictions/criteo"
    )
    p.add_argument(
        "--schema", default="data/schemas/criteo.yaml", help="schema for data files (default criteo)"
    )
    p.add_argument("--rows", type=int, default=200, help="rows per request for data files (default 200)")
    p.add_argument("--limit", type=int, help="score at most this many rows")
    p.add_argument("--key-file", help="TorchServe key_file.json when token auth is on")
    p.add_argument("--binary", action="store_true", help="send compact batches instead of JSON")


def run_score(args: argparse.Namespace) -> int:
    import orjson

    from serving.client import ScoringClient, requests_from_file

    client = ScoringClient(args.url, key_file=args.key_file)
    n = 0
    for body, ctype in requests_from_file(args.file, args.schema, args.rows, args.limit, args.binary):
        status, payload = client.post(body, ctype)
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
