"""TorchServe packaging of the local stack: its server configuration (ports, workers, batching,
token auth, the niced Python its handlers run on) and the model archive (MAR) of one dense
version: the scoring handler plus a ``scoring.json`` that points it at the version and at the
stack's worker, PS shards and TLS."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from serving.stack import tls as stack_tls
from serving.stack.config import StackConfig
from serving.stack.state import StackState

ROOT = Path(__file__).resolve().parents[2]
HANDLER = ROOT / "handlers" / "recserve_handler.py"


def torchserve_config(cfg: StackConfig, state: StackState, run_dir: Path):
    """The ``TorchServeConfig`` of the stack's TorchServe, on ``state.torchserve_ports``."""
    from serving.torchserve import TorchServeConfig
    from serving.torchserve.config import niced_python

    ports = state.torchserve_ports
    ts_store = run_dir / "torchserve-store"
    ts_store.mkdir(parents=True, exist_ok=True)
    python = niced_python(run_dir / "python-niced")
    return TorchServeConfig(
        model_store=ts_store, run_dir=run_dir / "torchserve", host=cfg.host,
        inference_port=ports[0], management_port=ports[1], metrics_port=ports[2],
        grpc_inference_port=ports[3], grpc_management_port=ports[4],
        default_workers_per_model=cfg.ts_workers, batch_size=cfg.batch_size,
        max_batch_delay_ms=cfg.max_batch_delay_ms, disable_token_auth=cfg.disable_token_auth, python=str(python),
    )  # fmt: skip


def scoring_json(cfg: StackConfig, state: StackState, vdir: Path) -> dict:
    """The handler's ``ScoringConfig`` fields for dense version ``vdir`` in this stack."""
    scoring = {"version_dir": str(vdir), "worker": state.worker, "runtime": cfg.runtime, "device": cfg.device, "poll_s": cfg.poll_s,
               "worker_timeout_s": cfg.worker_timeout_s, "max_items": cfg.max_items, "lookups": cfg.lookups}  # fmt: skip
    if cfg.worker_in_handler or cfg.lookups == "auto":
        scoring["ps"] = ["|".join(replicas) for replicas in state.ps_shards]
    if cfg.log_impressions:
        scoring["log_impressions"] = cfg.log_impressions
    scoring.update(stack_tls.scoring_fields(state))
    return scoring


def build_mar(cfg: StackConfig, state: StackState, run_dir: Path, vdir: Path, version: str) -> str:
    """Archive the handler + its scoring.json for ``vdir`` into TorchServe's store; the MAR's name."""
    from serving.torchserve import archive

    staging = run_dir / "mar-staging" / version
    staging.mkdir(parents=True, exist_ok=True)
    (staging / "scoring.json").write_text(json.dumps(scoring_json(cfg, state, vdir), indent=2))
    mar = archive(HANDLER, [staging / "scoring.json"], cfg.model, version, run_dir / "torchserve-store")
    shutil.rmtree(staging, ignore_errors=True)
    return mar.name
