"""``recserve versions`` / ``publish`` / ``rollback``: release management of the model store
(``model_store.releases``: the one gate, the one publish with HISTORY)."""

from __future__ import annotations

import sys
import time
import types
from dataclasses import dataclass, field

from recserve.config import store_field


@dataclass
class VersionsConfig:
    """``recserve versions``."""

    store: str = store_field()
    """Model-store root."""
    model: str = "criteo"
    """Model name in the store."""
    keep: int = 0
    """Delete all but the newest KEEP versions (never CURRENT or the rollback target; 0: keep all)."""


@dataclass
class PublishConfig:
    """``recserve publish``."""

    version: str = field(default="", metadata={"positional": True, "help": "version to make CURRENT"})
    """Version to make CURRENT."""
    store: str = store_field()
    """Model-store root."""
    model: str = "criteo"
    """Model name in the store."""
    schema_fingerprint: str = ""
    """Refuse unless the version's feature schema has this fingerprint."""

    def __post_init__(self) -> None:
        if not self.version:
            raise ValueError("give the VERSION to publish")


@dataclass
class RollbackConfig:
    """``recserve rollback``."""

    store: str = store_field()
    """Model-store root."""
    model: str = "criteo"
    """Model name in the store."""


def run_versions(cfg: VersionsConfig) -> int:
    from model_store.releases import list_versions, retain

    if cfg.keep:
        removed = retain(cfg.store, cfg.model, cfg.keep)
        print(f"removed: {', '.join(removed) if removed else 'nothing'}")
    rows = list_versions(cfg.store, cfg.model)
    if not rows:
        print(f"no versions of {cfg.model} in {cfg.store}")
    for r in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created)) if r.created else "-"
        auc = f"auc={r.metrics['auc']:.4f}" if r.metrics and "auc" in r.metrics else ""
        mark = "*" if r.current else " "
        print(f"{mark} {r.version:>4}  {r.status:<10} {created}  deltas={r.deltas:<3} {auc} {r.detail}")
    return 0


def run_publish(cfg: PublishConfig) -> int:
    from model_store import ModelStoreError, publish

    try:
        publish(cfg.store, cfg.model, cfg.version, cfg.schema_fingerprint or None)
    except ModelStoreError as e:
        print(f"refused: {e}", file=sys.stderr)
        return 1
    print(f"{cfg.model}: CURRENT -> {cfg.version}")
    return 0


def run_rollback(cfg: RollbackConfig) -> int:
    from model_store import ModelStoreError, rollback

    try:
        v = rollback(cfg.store, cfg.model)
    except ModelStoreError as e:
        print(f"refused: {e}", file=sys.stderr)
        return 1
    print(f"{cfg.model}: rolled back, CURRENT -> {v}")
    return 0


COMMANDS = {
    "versions": types.SimpleNamespace(CONFIG=VersionsConfig, run=run_versions),
    "publish": types.SimpleNamespace(CONFIG=PublishConfig, run=run_publish),
    "rollback": types.SimpleNamespace(CONFIG=RollbackConfig, run=run_rollback),
}
