"""``recserve versions`` / ``publish`` / ``rollback``: release management of the model store."""

from __future__ import annotations

import argparse
import sys
import time


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-store", default="model_store", help="model store root (default model_store)")
    p.add_argument("--model", required=True, help="model name")


def add_versions_arguments(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument(
        "--keep",
        type=int,
        help="delete all but the newest KEEP versions (never CURRENT or the rollback target)",
    )


def run_versions(args: argparse.Namespace) -> int:
    from serving.releases import list_versions, retain

    if args.keep:
        removed = retain(args.model_store, args.model, args.keep)
        print(f"removed: {', '.join(removed) if removed else 'nothing'}")
    rows = list_versions(args.model_store, args.model)
    if not rows:
        print(f"no versions of {args.model} in {args.model_store}")
    for r in rows:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.created)) if r.created else "-"
        auc = f"auc={r.metrics['auc']:.4f}" if r.metrics and "auc" in r.metrics else ""
        mark = "*" if r.current else " "
        print(f"{mark} {r.version:>4}  {r.status:<10} {created}  deltas={r.deltas:<3} {auc} {r.detail}")
    return 0


def add_publish_arguments(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("version", help="version to make CURRENT")
    p.add_argument(
        "--schema-fingerprint", help="refuse unless the version's feature schema has this fingerprint"
    )


def run_publish(args: argparse.Namespace) -> int:
    from serving.model_store import ModelStoreError
    from serving.releases import publish

    try:
        publish(args.model_store, args.model, args.version, args.schema_fingerprint)
    except ModelStoreError as e:
        print(f"refused: {e}", file=sys.stderr)
        return 1
    print(f"{args.model}: CURRENT -> {args.version}")
    return 0


def add_rollback_arguments(p: argparse.ArgumentParser) -> None:
    _common(p)


def run_rollback(args: argparse.Namespace) -> int:
    from serving.model_store import ModelStoreError
    from serving.releases import rollback

    try:
        v = rollback(args.model_store, args.model)
    except ModelStoreError as e:
        print(f"refused: {e}", file=sys.stderr)
        return 1
    print(f"{args.model}: rolled back, CURRENT -> {v}")
    return 0
